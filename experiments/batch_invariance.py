r"""A request's logits across engine sizes, with and without a batch-invariant decode.

No paper table. A handoff (PDD's relay: docs/DESIGN.md, "Moving a request between
engines") continues exactly only where the receiver computes the sender's numbers,
and XLA picks a matmul's blocking by its row count, so engines of other slot counts
do not; ``ModelConfig.decode_row_tile`` runs the decode's row-wise work over fixed
tiles of rows (SGLang's and vLLM's deterministic modes exist for the same reason).

Part 1: one request of ``--prompt_tokens`` of text served among random others (of
random lengths and arrivals) on engines of each ``--slots``, untiled and tiled;
its decode logits against the first slot count's. Part 2: the tiered step's time
at each ``--batch``, tiled against untiled, alternating step by step (median of
the per-round ratios).

Command (~5 min on a 2-core CPU):
  python -m experiments.batch_invariance
Last line: ``batch_invariance: tiled_max_abs_diff=X untiled_max_abs_diff=Y
step_ratio=R1/R2/...`` (tiled over untiled, one per ``--batch``).
Results: results/batch_invariance/<time>/.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import numpy as np

from experiments import common, model_setup, timing
from kvtier_jax.serving import Engine, EngineConfig
from kvtier_jax.serving.bench import RequestSpec, decode_logits_among, random_others
from models import backends, serving, setup
from models.transformer import Transformer

FLAGS = flags.FLAGS
flags.DEFINE_enum("backend", "tiered", ["tiered", "sparse"], "Serving backend.")
flags.DEFINE_list("slots", ["1", "3", "8"], "Engine slot counts (the first is the "
                  "reference).")
flags.DEFINE_integer("tile", 8, "decode_row_tile of the tiled model.", lower_bound=1)
flags.DEFINE_integer("new_tokens", 8, "Tokens the request generates.", lower_bound=2)
flags.DEFINE_list("batch", ["1", "8", "32"], "Requests per step in the timing part.")
flags.DEFINE_integer("time_prompt_tokens", 512, "Prompt length in the timing part.")
flags.DEFINE_integer("iters", 15, "Timed steps per variant (after 3 warm-up).")
flags.DEFINE_integer("seed", 0, "Other requests' prompts and arrivals.")
flags.DEFINE_string("out_root", None, "Results root.")


def request_logits(model, ids, slots: int, rng) -> tuple[list[int], np.ndarray]:
  """(the request's tokens, its decode logits [new_tokens - 1, V]) on an engine of
  ``slots`` slots, among ``slots + 1`` random requests."""
  selector, params = setup.build_selector(FLAGS.selector, model.cfg, FLAGS.top_k,
                                          FLAGS.indexer_ckpt)
  extra = dict(hot_slots=2 * selector.top_k) if FLAGS.backend == "tiered" else {}
  backend = serving.ServingBackend(model, FLAGS.backend, slots, len(ids) + FLAGS.new_tokens,
                                   selector=selector, selector_params=params, **extra)
  others = random_others(rng, slots + 1, model.cfg.vocab_size, (16, len(ids) + 1),
                         (1, FLAGS.new_tokens + 1))
  target, logits = decode_logits_among(
      Engine(backend, EngineConfig()),
      RequestSpec("request", tuple(map(int, ids)), FLAGS.new_tokens), others)
  return target.output, logits


def step_ms(models: dict, batch: int, rng) -> tuple[dict, dict]:
  """Tiered step time of each model at ``batch`` requests (interleaved)."""
  vocab = next(iter(models.values())).cfg.vocab_size
  prompt = rng.integers(0, vocab, (batch, FLAGS.time_prompt_tokens))
  steps = {}
  for name, model in models.items():
    selector, params = setup.build_selector(FLAGS.selector, model.cfg, FLAGS.top_k,
                                            FLAGS.indexer_ckpt)
    runner = backends.Runner(model, "tiered",
                             FLAGS.time_prompt_tokens + FLAGS.iters + 8,
                             selector=selector, selector_params=params,
                             hot_slots=2 * selector.top_k)
    runner.prefill(prompt, [FLAGS.time_prompt_tokens] * batch)
    feed = rng.integers(0, vocab, batch)
    steps[name] = lambda runner=runner: runner.step(feed)
  return timing.interleaved_ms(steps, warmup=3, iters=FLAGS.iters)


def main(argv):
  del argv
  model_setup.refuse_given(model_setup.NO_LOOKAHEAD, "this runner runs no look-ahead "
                           "(generate, serve and prefetch do)")
  if FLAGS.decode_row_tile is not None:
    raise app.UsageError("--decode_row_tile: this runner compares an untiled model with "
                         "one of --tile")
  model_setup.refuse_given(["impl"], "this runner's tiered cache runs the default "
                           "(XLA) step, whose batch invariance it measures")
  model, _, ids = model_setup.load_model_and_prompt(FLAGS.prompt_file, FLAGS.prompt_tokens,
                                                    FLAGS.offset)
  out = common.start_run("batch_invariance", FLAGS.flag_values_dict(), FLAGS.out_root)
  models = {"untiled": model, f"tile {FLAGS.tile}": Transformer.from_params(
      dataclasses.replace(model.cfg, decode_row_tile=FLAGS.tile), model.weights())}
  slots = [int(s) for s in FLAGS.slots]
  rows, worst = [], {}
  for name, m in models.items():
    rng = np.random.default_rng(FLAGS.seed)
    (tokens, first), *more = [request_logits(m, ids, s, rng) for s in slots]
    for count, (out_tokens, logits) in zip(slots, [(tokens, first), *more]):
      diff = float(np.abs(logits - first).max())
      worst[name] = max(worst.get(name, 0.0), diff)
      rows.append(dict(part="logits", model=name, slots=count, reference_slots=slots[0],
                       max_abs_diff=diff, same_bits=bool(np.array_equal(logits, first)),
                       same_tokens=out_tokens == tokens))
      common.append_row(out, rows[-1])
      print(f"{name}, {count} slots: max_abs_diff={diff:.3g} vs {slots[0]} slots",
            flush=True)
  ratios = []
  for batch in (int(b) for b in FLAGS.batch):
    medians, ratio = step_ms(models, batch, np.random.default_rng(FLAGS.seed))
    tiled = f"tile {FLAGS.tile}"
    rows.append(dict(part="step", batch=batch, untiled_ms=medians["untiled"],
                     tiled_ms=medians[tiled], tiled_over_untiled=ratio[tiled]))
    common.append_row(out, rows[-1])
    ratios.append(ratio[tiled])
    print(f"batch {batch}: untiled {medians['untiled']:.1f} ms, tiled "
          f"{medians[tiled]:.1f} ms ({ratio[tiled]:.2f}x)", flush=True)
  logits = [r for r in rows if r["part"] == "logits"]
  steps = [r for r in rows if r["part"] == "step"]
  (out / "table.md").write_text("\n".join([
      common.markdown_table(logits, ["model", "slots", "reference_slots", "max_abs_diff",
                                     "same_bits", "same_tokens"]), "",
      common.markdown_table(steps, ["batch", "untiled_ms", "tiled_ms",
                                    "tiled_over_untiled"])]) + "\n")
  common.bar_plot(out / "plot.png", [f"batch {r['batch']}" for r in steps],
                  [r["tiled_over_untiled"] for r in steps], "tiled / untiled step",
                  f"SmolLM2 {FLAGS.backend} step, decode_row_tile={FLAGS.tile}")
  print(f"results: {out}")
  print(f"batch_invariance: tiled_max_abs_diff={worst[f'tile {FLAGS.tile}']:.3g} "
        f"untiled_max_abs_diff={worst['untiled']:.3g} "
        f"step_ratio={'/'.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
  app.run(main)
