"""Serving workloads and engines shared by ``serve`` and ``serve_sweep`` (no flags).

Workloads are lists of ``kvtier_jax.serving.bench.RequestSpec`` / ``Rollout``:

* ``synthetic``: prompts cut at random offsets from a token stream (the bundled
  corpus for SmolLM2; random ids for dummy weights), lengths uniform in a range;
* ``load_jsonl``: the ``experiments.serve`` format, one request per line:
  ``{"id", "prompt": text | "prompt_ids": [...], "max_new_tokens", "arrival_s",
  "temperature", "top_k", "top_p", "seed", "stop_ids", "logprobs", "logprobs_mode"}``
  (all but the prompt and ``max_new_tokens`` optional). Sessions: ``{"id",
  "session": name, "append": text | "append_ids": [...], "max_new_tokens"}`` is a
  turn whose prompt is the session's history (earlier appends and the engine's
  own outputs) plus this append, sent when the session's previous turn finishes;
  sessions interleave in file order;
* ``sessions``: agent sessions whose turns append to a long history, with a
  ``skewed`` append-size distribution (most turns add a little, a tail adds a lot:
  most requests are >= 95% prefix hits) or a ``narrow`` one;
* ``rollouts``: RL trajectories (a long prompt, then generation turns separated by
  environment turns that append tokens), so continuation prefills keep arriving
  while other trajectories decode.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import numpy as np

from kvtier_jax.config import ImplConfig
from kvtier_jax.serving import Engine, EngineConfig, SamplingParams
from kvtier_jax.serving.bench import Rollout, RequestSpec, drive
from kvtier_jax.serving.request import is_int
from models import serving, sharded_serving


def synthetic(stream: np.ndarray, rng: np.random.Generator, num: int,
              prompt_range: Sequence[int], output_range: Sequence[int],
              arrivals: Sequence[float] | None = None) -> list[RequestSpec]:
  """``num`` requests; prompt / output lengths uniform in the (inclusive) ranges."""
  lo, hi = prompt_range
  if len(stream) <= hi:
    raise ValueError(f"the token stream ({len(stream)}) is shorter than a prompt ({hi})")
  out = []
  for i in range(num):
    plen = int(rng.integers(lo, hi + 1))
    start = int(rng.integers(0, len(stream) - plen))
    out.append(RequestSpec(f"r{i}", tuple(int(t) for t in stream[start:start + plen]),
                           int(rng.integers(output_range[0], output_range[1] + 1)),
                           0.0 if arrivals is None else float(arrivals[i])))
  return out


def shared_prefix(stream: np.ndarray, rng: np.random.Generator, num: int, groups: int,
                  prefix_len: int, question_range: Sequence[int],
                  output_range: Sequence[int],
                  arrivals: Sequence[float] | None = None) -> list[RequestSpec]:
  """``num`` requests in ``groups`` groups (SGLang's generated-shared-prefix): each
  group's requests share a ``prefix_len``-token system prompt and add their own
  question (lengths uniform in ``question_range``); group picked at random."""
  lo, hi = question_range
  if len(stream) <= prefix_len + hi:
    raise ValueError(f"the token stream ({len(stream)}) is shorter than a prompt "
                     f"({prefix_len} + {hi})")

  def window(length):
    start = int(rng.integers(0, len(stream) - length))
    return tuple(int(t) for t in stream[start:start + length])

  prefixes = [window(prefix_len) for _ in range(groups)]
  out = []
  for i in range(num):
    group = int(rng.integers(groups))
    prompt = prefixes[group] + window(int(rng.integers(lo, hi + 1)))
    out.append(RequestSpec(f"g{group}-r{i}", prompt,
                           int(rng.integers(output_range[0], output_range[1] + 1)),
                           0.0 if arrivals is None else float(arrivals[i])))
  return out


def rollouts(stream: np.ndarray, rng: np.random.Generator, num: int, prompt_len: int,
             turns: int, gen_tokens: int, env_tokens: int, env_seconds: float,
             arrivals: Sequence[float] | None = None) -> list[Rollout]:
  """``num`` trajectories of ``turns`` generations of ``gen_tokens``; each
  environment turn appends ``env_tokens`` tokens of the stream after ``env_seconds``."""
  out = []
  need = prompt_len + (turns - 1) * env_tokens
  for i in range(num):
    start = int(rng.integers(0, len(stream) - need))
    piece = [int(t) for t in stream[start:start + need]]
    envs = tuple(tuple(piece[prompt_len + j * env_tokens:prompt_len + (j + 1) * env_tokens])
                 for j in range(turns - 1))
    out.append(Rollout(f"traj{i}", tuple(piece[:prompt_len]), (gen_tokens,) * turns, envs,
                       0.0 if arrivals is None else float(arrivals[i]), env_seconds))
  return out


def parse_sampling(pairs: Sequence[str]) -> SamplingParams:
  """``SamplingParams`` from ``key=value`` strings (a runner's ``--sampling``),
  checked: ``["temperature=1", "top_p=0.95"]``."""
  names = [f.name for f in dataclasses.fields(SamplingParams)]
  fields = {}
  for pair in pairs:
    key, eq, value = pair.partition("=")
    if not eq or key not in names:
      raise ValueError(f"--sampling {pair!r}: want key=value, key one of {names}")
    kind = dict(temperature=float, top_p=float, logprobs_mode=str).get(key, int)
    try:
      fields[key] = kind(value)
    except ValueError:
      raise ValueError(f"--sampling {pair!r}: {value!r} is not of type {kind.__name__}"
                       ) from None
  sampling = SamplingParams(**fields)
  sampling.check()
  return sampling


def sampled(workload: list, sampling: SamplingParams) -> list:
  """``workload`` with every request (or trajectory) drawing by ``sampling`` (each
  keeps the seed its id gives it, unless ``sampling`` has one)."""
  return [dataclasses.replace(item, sampling=sampling) for item in workload]


def load_jsonl(path: str | pathlib.Path, tokenizer) -> list[RequestSpec | Rollout]:
  out, sessions = [], {}
  for n, line in enumerate(pathlib.Path(path).read_text().splitlines()):
    if not line.strip():
      continue
    row = json.loads(line)
    where = f"{path}:{n + 1}"
    if "session" in row:
      if "stop_ids" in row:
        raise ValueError(f"{where}: a session turn takes no stop_ids (sessions stop at "
                         "max_new_tokens or the engine's eos_ids)")
      ids = _ids(row, "append", tokenizer, where)
      turn = (str(row.get("id", f"r{n}")), ids, _int(row, "max_new_tokens", where),
              _sampling(row, where))
      if row["session"] not in sessions:
        sessions[row["session"]] = [float(row.get("arrival_s", 0.0))]
        out.append(row["session"])  # a placeholder, in file order
      sessions[row["session"]].append(turn)
      continue
    out.append(RequestSpec(str(row.get("id", f"r{n}")), _ids(row, "prompt", tokenizer, where),
                           _int(row, "max_new_tokens", where),
                           float(row.get("arrival_s", 0.0)), _sampling(row, where),
                           _int_list(row.get("stop_ids", ()), "stop_ids", where)))
  for i, item in enumerate(out):
    if isinstance(item, str):
      arrival, *turns = sessions[item]
      samplings = {t[3] for t in turns}
      if len(samplings) > 1:
        raise ValueError(f"{path}: session {item!r} mixes sampling parameters")
      out[i] = Rollout(item, turns[0][1], tuple(t[2] for t in turns),
                       tuple(t[1] for t in turns[1:]), arrival, 0.0, turns[0][3],
                       tuple(t[0] for t in turns))
  return out


def _ids(row: dict, name: str, tokenizer, where: str) -> tuple[int, ...]:
  if f"{name}_ids" in row:
    return _int_list(row[f"{name}_ids"], f"{name}_ids", where)
  if name in row:
    return tuple(tokenizer.encode(row[name], add_special_tokens=False).ids)
  raise ValueError(f"{where}: a request needs {name!r} or '{name}_ids'")


def _int_list(values, key: str, where: str) -> tuple[int, ...]:
  """Integer ids as given: int() would truncate 1.9 into the id 1 silently."""
  if not isinstance(values, (list, tuple)) or not all(map(is_int, values)):
    raise ValueError(f"{where}: {key} must be a list of integers, not {values!r}")
  return tuple(values)


def _int(row: dict, key: str, where: str, default: int | None = None) -> int:
  value = row.get(key, default)
  if not is_int(value):
    raise ValueError(f"{where}: {key} must be an integer, not {value!r}")
  return value


def _sampling(row: dict, where: str) -> SamplingParams:
  sampling = SamplingParams(temperature=float(row.get("temperature", 0.0)),
                            top_k=_int(row, "top_k", where, 0),
                            top_p=float(row.get("top_p", 1.0)),
                            seed=_int(row, "seed", where) if "seed" in row else None,
                            logprobs=(_int(row, "logprobs", where) if "logprobs" in row
                                      else None),
                            logprobs_mode=row.get("logprobs_mode", "raw"))
  try:
    sampling.check()
  except ValueError as err:
    raise ValueError(f"{where}: {err}") from None
  return sampling


def sessions(stream: np.ndarray, rng: np.random.Generator, num: int, first_len: int,
             turns: int, output_len: int, appends: str) -> list[Rollout]:
  """``num`` agent sessions of ``turns`` turns: a ``first_len``-token first prompt,
  then appends of ``skewed`` sizes (85% of 8-32 tokens, 15% of 1/4-1/2 of the
  first prompt: a few low-hit requests) or ``narrow`` ones (all 1/8-1/4 of it)."""
  if appends not in ("skewed", "narrow"):
    raise ValueError(f"appends={appends!r} must be 'skewed' or 'narrow'")
  out = []
  for i in range(num):
    sizes = []
    for _ in range(turns - 1):
      if appends == "narrow":
        sizes.append(int(rng.integers(first_len // 8, first_len // 4 + 1)))
      elif rng.random() < 0.85:
        sizes.append(int(rng.integers(8, 33)))
      else:
        sizes.append(int(rng.integers(first_len // 4, first_len // 2 + 1)))
    start = int(rng.integers(0, len(stream) - first_len - sum(sizes)))
    piece = [int(t) for t in stream[start:start + first_len + sum(sizes)]]
    cuts = np.cumsum([first_len, *sizes])
    envs = tuple(tuple(piece[a:b]) for a, b in zip(cuts[:-1], cuts[1:]))
    out.append(Rollout(f"s{i}", tuple(piece[:first_len]), (output_len,) * turns, envs))
  return out


def build_backend(model, cache: str, *, selector, params, max_batch: int, max_len: int,
                  chunk_size: int, page_size: int, hot_slots: int,
                  host_budget_mib: float, mesh=None, device=None,
                  impl: ImplConfig | None = None, lookahead: str = "none",
                  lookahead_cap: int | None = None) -> serving.ServingBackend:
  """``model`` with one cache backend (dense / sparse / tiered) over ``max_batch``
  slots (nothing is allocated until an engine starts on it); over a ``mesh`` the
  slots and the host budget split over its data rows, the KV heads over ``model``.
  ``impl``: the tiered cache's implementation (default: the library's);
  ``lookahead``: "draft" prefetches by a draft pass (tiered, one device)."""
  extra = {}
  if cache == "tiered":
    extra = dict(hot_slots=hot_slots, host_pages=serving.ServingBackend.pages_for_bytes(
        model.cfg, page_size, host_budget_mib * 2**20))
    if impl is not None:
      extra["impl"] = impl
  if lookahead != "none":
    extra["lookahead"] = lookahead
    if lookahead_cap is not None:
      extra["lookahead_cap"] = lookahead_cap
  if cache != "dense":
    extra.update(selector=selector, selector_params=params)
  if mesh is not None and mesh.size > 1:
    return sharded_serving.MeshServingBackend(
        model, cache, max_batch, max_len, mesh=mesh, chunk_size=chunk_size,
        page_size=page_size, **extra)
  return serving.ServingBackend(model, cache, max_batch, max_len, chunk_size=chunk_size,
                                page_size=page_size, device=device, **extra)


def engine_config(backend, *, max_step_tokens: int, kv_budget_mib: float | None = None,
                  prefill_policy: str = "decode_first", prefix_cache: bool = False,
                  disk_budget_mib: float = 0.0, disk_policy: str = "auto",
                  schedule: str = "fcfs") -> EngineConfig:
  """The engine's config; ``disk_budget_mib`` > 0 adds a disk tier below the host
  pool for cached prefixes (in a temporary directory)."""
  budget = None if kv_budget_mib is None else int(kv_budget_mib * 2**20)
  disk_pages = (int(disk_budget_mib * 2**20 // backend.host_page_bytes)
                if disk_budget_mib and backend.host_page_bytes else 0)
  return EngineConfig(max_step_tokens=max_step_tokens, kv_budget_bytes=budget,
                      prefill_policy=prefill_policy, prefix_cache=prefix_cache,
                      disk_pages=disk_pages, disk_policy=disk_policy, schedule=schedule)


def build_engine(backend, *, on_step=None, **config) -> Engine:
  """An engine over ``backend`` (``config``: ``engine_config``'s)."""
  return Engine(backend, engine_config(backend, **config), on_step=on_step)


def admissible(backend, kv_budget_mib: float | None, length: int) -> tuple[int, str]:
  """(requests of ``length`` positions the backend holds at once under the budget,
  what bounds it: "slots", "device" or "host")."""
  bounds = {"slots": backend.num_slots}
  if kv_budget_mib is not None:
    bounds["device"] = max(0, int(kv_budget_mib * 2**20) - backend.staging_bytes()
                           ) // backend.device_bytes(length)
  pages = backend.host_pages(length)
  if pages:
    bounds["host"] = backend.num_host_pages // pages
  bound = min(bounds, key=lambda k: (bounds[k], k != "slots"))
  return int(bounds[bound]), bound


def warm_up(engine: Engine, spec: RequestSpec, chunk_size: int) -> None:
  """Compile the prefill, the decode step, the sampler and the log-probabilities on
  a throwaway engine (the jitted functions are shared), so no measured request pays
  for compiling.
  Three tokens: the first decode step is not the request's last, so a look-ahead's
  draft pass compiles too. With a prefix cache a second request repeats the
  prompt, which compiles the prefix load too (its first chunk is then cached)."""
  prompt = spec.prompt[:chunk_size + 1]
  # logprobs=0: the log-probabilities' call compiles too (one program for every N
  # and mode).
  drive(engine, [RequestSpec("warm-up", prompt, 3, sampling=SamplingParams(logprobs=0))])
  if engine.config.prefix_cache:
    drive(engine, [RequestSpec("warm-up (prefix hit)", prompt, 3)])
