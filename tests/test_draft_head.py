"""The EAGLE-style draft head: its examples line up, it learns a rule it can learn,
it survives a checkpoint bit for bit, and its runner reports against the baselines."""

import json
import pathlib
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax import draft
from models import draft_head, text
from models import transformer as tfm
from models.config import ModelConfig
from tests.oracles import prompt_lookup_oracle
from tests.util import SMOKE_LAYERS, smollm2_or_skip


def tiny_model():
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=2,
                                 num_q_heads=4, num_kv_heads=2, head_dim=8,
                                 ffn_hidden_dim=48, name="tiny")
  weights = tfm.Transformer(cfg, rngs=nnx.Rngs(0)).weights()
  # The readout is the tied embedding of a normalised feature: at the random init's
  # scale (|e| ~ 0.02) no logit gap can exceed ~1, so no rule could be learned.
  return cfg, dict(weights, embed=weights["embed"] * 100)


def test_examples_pair_the_previous_feature_and_token_with_the_next():
  feats = np.arange(6)[:, None] * np.ones((6, 3))
  tokens = np.arange(10, 16)
  feat_prev, token, feat_next, label = draft_head.examples(feats, tokens)
  np.testing.assert_array_equal(feat_prev[:, 0], [0, 1, 2, 3])  # f_{p-1}
  np.testing.assert_array_equal(token, [11, 12, 13, 14])  # x_p
  np.testing.assert_array_equal(feat_next[:, 0], [1, 2, 3, 4])  # f_p
  np.testing.assert_array_equal(label, [12, 13, 14, 15])  # x_{p+1}


def test_weight_decay_shrinks_the_projections_not_the_norm_scale():
  """With zero gradients an AdamW update is the decay alone: it must move every
  projection kernel and leave the RMSNorm scale (ones) as it is."""
  head = draft_head.DraftHead(8, 16, rngs=nnx.Rngs(0))
  before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(head, nnx.Param))}
  opt = draft_head.optimizer(head, draft_head.TrainConfig(steps=10, lr=1.0,
                                                          weight_decay=0.5))
  for _ in range(3):  # past the warm-up's zero learning rate
    opt.update(head, jax.tree.map(jnp.zeros_like, nnx.state(head, nnx.Param)))
  after = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(head, nnx.Param))}
  for key, value in before.items():
    if "norm" in key:
      np.testing.assert_array_equal(after[key], value)
    elif np.any(value):  # (the zero-initialised output projection stays zero)
      assert np.all(np.abs(after[key]) < np.abs(value) + 1e-12) and np.any(
          after[key] != value), key


def test_the_head_adds_a_residual_to_the_previous_feature():
  """f_p = f_{p-1} + head(...): a head whose output projection is zero drafts the
  token the previous feature's own readout gives."""
  cfg, weights = tiny_model()
  rng = np.random.default_rng()
  head = draft_head.DraftHead(cfg.embed_dim, 16, rngs=nnx.Rngs(int(rng.integers(2**31))))
  head.down.kernel.value = jnp.zeros_like(head.down.kernel.value)
  feat = jnp.asarray(rng.standard_normal((32, cfg.embed_dim)), jnp.float32)
  token = jnp.asarray(rng.integers(0, cfg.vocab_size, 32), jnp.int32)
  got = np.asarray(draft_head.draft_tokens(cfg, weights, head, feat, token))
  want = np.asarray(jnp.argmax(tfm.lm_head(cfg, weights, feat), -1))
  np.testing.assert_array_equal(got, want)


def test_head_learns_a_learnable_next_token_rule_and_round_trips(tmp_path):
  """Labels a function of the current token (x_{p+1} = (x_p + 3) mod V): the head
  must reach far above chance from features that carry nothing (zeros); the
  restored checkpoint drafts the same tokens."""
  cfg, weights = tiny_model()
  rng = np.random.default_rng()
  token = rng.integers(0, cfg.vocab_size, 4096).astype(np.int32)
  label = (token + 3) % cfg.vocab_size
  zeros = jnp.zeros((token.size, cfg.embed_dim))
  tc = draft_head.TrainConfig(steps=150, batch=128, lr=1e-2, hidden_dim=64,
                              feature_weight=0.0)
  head, history = draft_head.train(cfg, weights, zeros, jnp.asarray(token), zeros,
                                   jnp.asarray(label), tc)
  assert history[-10:, 1].mean() < 0.5 * history[:10, 1].mean()
  fresh = rng.integers(0, cfg.vocab_size, 512).astype(np.int32)
  got = np.asarray(draft_head.draft_tokens(cfg, weights, head, zeros[:512],
                                           jnp.asarray(fresh)))
  assert (got == (fresh + 3) % cfg.vocab_size).mean() > 0.8  # chance: 1/64
  path = draft_head.save(tmp_path / "head", head, {"model_layers": cfg.num_layers},
                         weights=weights)
  again = draft_head.load(path, num_layers=cfg.num_layers, weights=weights)
  np.testing.assert_array_equal(
      np.asarray(draft_head.draft_tokens(cfg, weights, again, zeros[:512],
                                         jnp.asarray(fresh))), got)
  with pytest.raises(ValueError, match="first 2 layers"):  # another cut's features
    draft_head.load(path, num_layers=cfg.num_layers + 1)
  with pytest.raises(ValueError, match="width"):  # another model's features
    draft_head.load(path, num_layers=cfg.num_layers, embed_dim=cfg.embed_dim + 64)
  draft_head.load(path, embed_dim=cfg.embed_dim)  # its own width: loads
  # Another model of the same shape (one weight of the final norm moved by an ulp).
  tuned = dict(weights, final_norm=weights["final_norm"].at[rng.integers(cfg.embed_dim)]
               .set(np.nextafter(np.float32(1), np.float32(2))))
  with pytest.raises(ValueError, match="another model"):
    draft_head.load(path, num_layers=cfg.num_layers, weights=tuned)
  # A fine-tune of one element of one layer's weight, anywhere in it.
  name = sorted(k for k in weights if k not in ("embed", "final_norm"))[
      rng.integers(len(weights) - 2)]
  flat = np.asarray(weights[name]).ravel().copy()
  flat[rng.integers(flat.size)] += np.float32(1e-3)
  tuned = dict(weights, **{name: jnp.asarray(flat.reshape(weights[name].shape))})
  with pytest.raises(ValueError, match="another model"):
    draft_head.load(path, num_layers=cfg.num_layers, weights=tuned)
  # Saved without the fingerprint: loads, with a warning that nothing was checked.
  unchecked = draft_head.save(tmp_path / "unchecked", head)
  with pytest.warns(UserWarning, match="not checked"):
    draft_head.load(unchecked, num_layers=cfg.num_layers, weights=tuned)
  (path / "draft_head.json").write_text(json.dumps({"format": "other"}))
  with pytest.raises(ValueError, match="format"):
    draft_head.load(path)


def test_prompt_lookup_matches_brute_force_and_defers_to_the_head():
  """``ngram_match`` on random short-alphabet histories against a brute force;
  ``PromptLookup`` fed the same history in random pieces answers as it does after
  each piece; ``lookup_or_head`` takes the head's token exactly where n <
  min_match."""
  from models import backends
  rng = np.random.default_rng()
  for _ in range(300):
    history = rng.integers(0, int(rng.integers(2, 9)), int(rng.integers(1, 30))).tolist()
    want = prompt_lookup_oracle(history)
    assert draft.ngram_match(history) == want, history
    lookup, fed = draft.PromptLookup(), 0
    while fed < len(history):
      piece = int(rng.integers(1, 6))
      lookup.extend(history[fed:fed + piece])
      fed = min(len(history), fed + piece)
      assert lookup.match() == prompt_lookup_oracle(history[:fed]), history[:fed]
    assert draft.ngram_draft(history) == want[0]
    for min_match in (1, 2, 3):
      got = backends.lookup_or_head(draft.ngram_match(history), -7, min_match)
      assert got == (want[0] if want[1] >= min_match else -7), (history, min_match)


def test_heldout_and_test_texts_are_disjoint_from_the_training_text():
  heldout = text.load_heldout_text()
  assert len(heldout) > 100_000
  train = text.load_text()

  def windows(t, n=100):  # every passage of n characters (not text.passages' hashes)
    return {t[i:i + n] for i in range(len(t) - n + 1)}

  # No passage of 100 characters of the held-out text appears in the training text.
  assert text.SHARED_PASSAGE == 100 and not windows(heldout) & windows(train)
  assert text.load_text(text.HELDOUT) == heldout  # --prompt_file=heldout

  # The test text (final reports only) shares no module, and no such passage, with
  # either (an inherited docstring, enum.Enum's, did).
  test = text.load_test_text()
  assert len(test) > 100_000 and not set(text.TEST_MODULES) & set(text.HELDOUT_MODULES)
  assert not windows(test) & (windows(train) | windows(heldout))
  assert text.load_text(text.TEST) == test  # --prompt_file=test


def test_texts_refuse_an_interpreter_that_strips_docstrings():
  """Under -OO the held-out and test texts would silently be other, shorter texts."""
  done = subprocess.run([sys.executable, "-OO", "-c",
                         "from models import text; text.load_heldout_text()"],
                        capture_output=True, text=True, check=False,
                        cwd=pathlib.Path(__file__).parents[1])
  assert done.returncode and "strips the docstrings" in done.stderr, done.stderr[-500:]


def test_latest_trace_picks_the_newest_full_run_of_each_text(tmp_path, monkeypatch):
  import json as json_lib

  from experiments import common
  monkeypatch.setattr(common, "RESULTS", tmp_path)
  full = common.FULL_TRACE_STEPS
  for name, prompt_file, smoke, layers, steps in [
      ("20260101-000000", None, False, None, full),
      ("20260101-000001", "heldout", False, None, full + 1),
      ("20260101-000002", None, True, None, full),
      ("20260101-000003", None, False, 2, full),
      ("20260101-000004", None, False, None, full - 1),
      ("20260101-000005", "heldout", False, None, 32)]:
    run_dir = tmp_path / "trace" / name
    run_dir.mkdir(parents=True)
    (run_dir / "traces.npz").write_bytes(b"")
    (run_dir / "config.json").write_text(json_lib.dumps(
        {"flags": {"prompt_file": prompt_file, "smoke": smoke, "model_layers": layers,
                   "steps": steps}}))
  # The default is the pydoc text's (miss_rate's table read a newer held-out trace),
  # of the whole model (a --model_layers run is another model's selections), of
  # every step (a --steps=32 run's tables sit in the miss-rate ramp).
  assert common.latest_trace().parent.name == "20260101-000000"
  assert common.latest_trace("any").parent.name == "20260101-000001"
  assert common.latest_trace(None).parent.name == "20260101-000000"
  assert common.latest_trace(text.HELDOUT).parent.name == "20260101-000001"
  with pytest.raises(FileNotFoundError, match="--prompt_file=other"):
    common.latest_trace("other")


def run(module, *args):
  proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc.stdout


# A runner whose model load stops the process (the refusal must come before it).
NO_MODEL_RUNNER = """
import sys
from absl import app
from models import setup
from experiments import {module} as runner

def load_model_and_prompt(*args, **kwargs):
  raise SystemExit("the runner loaded the model")

setup.load_model_and_prompt = load_model_and_prompt
app.run(runner.main, argv=["{module}", *sys.argv[1:]])
"""


@pytest.mark.parametrize("module,flags", [("prefetch", ()),
                                          ("generate", ("--lookahead=draft",))])
def test_a_head_is_refused_on_its_training_text_before_the_model_loads(tmp_path, module,
                                                                      flags):
  """From the checkpoint's metadata alone: a run refused after it loaded the model
  and prefilled had spent a minute on a run it could not report."""
  windows, window = (int(x) for x in np.random.default_rng().integers(2, 9, size=2))
  (tmp_path / "draft_head.json").write_text(json.dumps(dict(metadata=dict(
      trained_on="pydoc_data.topics", windows=windows, window=window))))

  def runner(*more):
    return subprocess.run([sys.executable, "-c", NO_MODEL_RUNNER.format(module=module),
                           f"--draft_ckpt={tmp_path}", *flags, *more],
                          capture_output=True, text=True, timeout=300)

  refused = runner(f"--offset={windows * window - 1}")
  assert refused.returncode != 0
  assert (f"was trained on the pydoc text's first {windows * window} tokens"
          in refused.stderr), refused.stderr[-2000:]
  assert "the runner loaded the model" not in refused.stderr
  # Past the span it trained on, the runner goes on to load the model.
  past = runner(f"--offset={windows * window}")
  assert "the runner loaded the model" in past.stderr, past.stderr[-2000:]


GENERATE_FLAG_CHECKS = """
from absl import flags
from models import setup
from experiments import generate

class Loaded(Exception):
  pass

def load_model_and_prompt(*args, **kwargs):
  raise Loaded

setup.load_model_and_prompt = load_model_and_prompt
for args in {cases!r}:
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["generate", *args])
  try:
    generate.main([])
  except Loaded:
    print("loaded")
  except ValueError as e:
    print("refused:", e)
"""


def test_generate_refuses_its_flag_combinations_before_the_model_loads():
  """A lookahead without the tiered cache, and a draft head without the lookahead
  it drafts for, ran a minute and then ignored the flag; the combinations that
  make sense go on to load the model."""
  cases = [(("--cache=sparse", "--lookahead=draft"), "refused: --lookahead needs --cache=tiered"),
           (("--cache=dense", "--lookahead=draft"), "refused: --lookahead needs --cache=tiered"),
           (("--draft_ckpt=/nonexistent",), "refused: --draft_ckpt drafts for --lookahead=draft"),
           (("--cache=tiered", "--lookahead=draft"), "loaded"),
           (("--cache=sparse",), "loaded")]
  code = GENERATE_FLAG_CHECKS.format(cases=[args for args, _ in cases])
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.splitlines() == [want for _, want in cases]


def rows_of(root, experiment):
  return [json.loads(l) for l in next(root.glob(f"{experiment}/*/rows.jsonl"))
          .read_text().splitlines()]


@pytest.mark.slow  # end to end in subprocesses: CI runs it (--runslow)
def test_draft_head_runner_and_its_prefetch_on_the_heldout_text(tmp_path):
  """The runner trains, saves and scores the head beside prompt lookup and the
  model's own token; the prefetch study then uses the checkpoint on the held-out
  text, one predictor per draft (SmolLM2's first ``SMOKE_LAYERS`` layers, for
  speed)."""
  smollm2_or_skip()
  layers = f"--model_layers={SMOKE_LAYERS}"
  run("experiments.draft_head", "--smoke", layers, "--steps=8", f"--out_root={tmp_path}")
  # config.json records what ran: the smoke's sizes, and the --steps given.
  flags_ran = json.loads(next(tmp_path.glob("draft_head/*/config.json")).read_text())["flags"]
  assert {k: flags_ran[k] for k in ("window", "train_windows", "eval_windows", "steps")} \
      == dict(window=128, train_windows=2, eval_windows=1, steps=8)
  by = {r["draft"]: r for r in rows_of(tmp_path, "draft_head")}
  assert set(by) == {"draft head", "prompt lookup", "prompt lookup (n >= 2), else draft head",
                     "model's next token (after the step)"}
  assert by["model's next token (after the step)"]["acceptance_vs_greedy"] == 1.0
  # Its first and last losses average disjoint steps (8 steps: 4 and 4).
  assert by["draft head"]["train_loss_first"] != by["draft head"]["train_loss_last"]
  run_dir = next(tmp_path.glob("draft_head/*"))
  prefetch = ("experiments.prefetch", "--smoke", "--selectors=quest",
              f"--out_root={tmp_path}", f"--prompt_file={run_dir / 'heldout.txt'}",
              f"--draft_ckpt={run_dir / 'draft_head'}")
  run(*prefetch, layers)
  rows = {r["variant"]: r for r in rows_of(tmp_path, "prefetch")}
  for kind in ("draft token", "draft head", "lookup, else head", "model's next token"):
    assert 0.0 < rows[f"prefetch: {kind}"]["agreement"] <= 1.0
    assert rows[f"prefetch: {kind}"]["critical_miss_rate"] >= 0.0
  # A perfect predictor: every row it prefetched is used, and fewer misses stay.
  ceiling = rows["prefetch: next selection (offline)"]
  assert ceiling["agreement"] == 1.0 and ceiling["useful_share"] == 1.0
  assert ceiling["critical_miss_rate"] < rows["sync (no prefetch)"]["critical_miss_rate"]
  # Nothing prefetched: no share of it (it read 0%).
  assert rows["sync (no prefetch)"]["useful_share"] is None
  # The smoke's 12 steps are what config.json says ran (it said 128).
  config = json.loads(next(tmp_path.glob("prefetch/*/config.json")).read_text())
  assert config["flags"]["steps"] == 12
  # The head is refused on the text it was trained on (the pydoc default).
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, "-m", "experiments.prefetch", "--smoke",
                         "--selectors=quest", f"--out_root={tmp_path / 'leak'}",
                         f"--draft_ckpt={run_dir / 'draft_head'}", layers],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode != 0 and "was trained on the pydoc text" in proc.stderr
  # An index sharing the IO model's 78 layers cannot have is refused, not modelled
  # with the wrong anchor count.
  proc = subprocess.run([sys.executable, "-m", "experiments.prefetch", "--smoke",
                         "--share=4", f"--out_root={tmp_path / 'share'}", layers],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode != 0 and "--share=4 must divide" in proc.stderr
  # Shared flags it would not read: refused.
  for flag in ("--impl=fused", "--selector=dsa"):
    proc = subprocess.run([sys.executable, "-m", "experiments.prefetch", "--smoke", flag,
                           f"--out_root={tmp_path / 'ignored'}", layers],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and f"{flag.split('=')[0]}: this runner" in proc.stderr
  # The CLI's look-ahead with the head: the library's jitted draft pass prefetches,
  # and the greedy tokens are those of the run without it.
  generate = ("experiments.generate", layers, f"--prompt_file={run_dir / 'heldout.txt'}",
              "--prompt_tokens=128", "--steps=6", "--top_k=16")
  def continuation(stdout):
    return next(l for l in stdout.splitlines() if l.startswith("continuation:"))
  plain = run(*generate)
  ahead = run(*generate, "--lookahead=draft", f"--draft_ckpt={run_dir / 'draft_head'}")
  assert continuation(ahead) == continuation(plain)
  assert "lookahead (lookup, else head): draft accepted" in ahead
  assert "/5;" in ahead  # one draft per step after the first
