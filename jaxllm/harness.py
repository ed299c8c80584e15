"""EleutherAI's lm-evaluation-harness (`lm_eval`) over a jaxllm run: the model type `jaxllm`.

    jaxllm eval RUN_DIR --harness TASKS [--include-path DIR] [--limit N] [--num-fewshot K]
    python -m jaxllm.harness --model jaxllm --model_args run=RUN_DIR --tasks TASKS [...]
    import jaxllm.harness; lm_eval.simple_evaluate(model="jaxllm", model_args="run=RUN_DIR", ...)

lm_eval 0.4.13 finds a model type only in its own table or in `register_model` calls made by an
import, so importing this module registers `jaxllm`; `python -m jaxllm.harness` is lm_eval's own
command line (every flag) with it registered. An installed jaxllm also registers it lazily in
every `lm_eval` (the `jaxllm_lm_eval.pth` hook, _jaxllm_lm_eval.py), so `lm_eval --model jaxllm
--model_args run=RUN_DIR` works as is. `model_args`: `run` (a run directory or checkpoint
path), `checkpoint` (best|last|STEP), `batch_size` (rows per forward pass and engine slots),
`max_length` (default model.max_seq_len), `max_gen_toks` (default 256) and any run key with a
dot, as an override (`generate.kv_cache_dtype=int8`). `device` is lm_eval's and is not read:
the run's mesh places the model.

The requests are answered as the harness's Hugging Face backend (`hf`) answers them on the
exported model (`jaxllm convert export`), so the scores agree: text is encoded by the tokenizer
an export writes (BOS first when the run trains with data.add_bos); `loglikelihood` scores the
continuation's tokens in one causal pass over context + continuation, left-truncated to
max_length; `loglikelihood_rolling` sums the harness's disjoint windows of max_length tokens
after the BOS (else EOS) prefix; `generate_until` decodes greedily on the inference engine
(`jaxllm.infer.engine.batch`) for at most max_gen_toks tokens from the context left-truncated to
max_length - max_gen_toks, ends at the tokenizer's and generation_config.json's stop ids or at
an `until` string, and cuts the text at the first `until` string. Sampling requests
(`do_sample: true`) are refused: only greedy decoding reproduces a score.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import lm_eval.models  # noqa: F401  (lm_eval's own table: its registry imports it only when empty)
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from jaxllm import sharding
from jaxllm.config import ConfigError, split_args
from jaxllm.config.urls import check_url
from jaxllm.convert.export import exported_backend
from jaxllm.data.tokenizer import (
    HFTokenizer,
    generation_config,
    generation_stop_ids,
    make_tokenizer,
)
from jaxllm.infer.engine import batch as engine_batch
from jaxllm.load import fetched, resolve, restore

MIN_BUCKET = 16
"""The shortest padded length of a scoring batch; lengths round up to powers of two from it."""


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _token_scores(graphdef, state, tokens_BxT, targets_BxT):
    """Log-probabilities [B, T] of `targets_BxT` under the model's next-token distribution at
    each position of `tokens_BxT`, and whether each target is the argmax."""
    logits_BxTxV = nnx.merge(graphdef, state)(tokens_BxT).logits.astype(jnp.float32)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    logp_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return logp_BxT, jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT


def _positive(name: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(number) != str(value).strip():
        raise ConfigError(f"model_args {name} must be a whole number >= 1, not {value!r}.")
    return number


class _Text:
    """The run's tokenizer as the exported Hugging Face directory's `AutoTokenizer` encodes and
    decodes: a tokenizer.json with the export's post-processor; the byte and SentencePiece
    tokenizers with BOS first when data.add_bos."""

    def __init__(self, data_cfg):
        self.tok = make_tokenizer(data_cfg)
        self.backend = None
        if isinstance(self.tok, HFTokenizer):
            self.backend = exported_backend(data_cfg, self.tok)[0]
        self.bos = [self.tok.bos_id] if data_cfg.add_bos and self.tok.bos_id is not None else []

    def encode(self, text: str, specials: bool = True) -> list[int]:
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=specials).ids
        return (self.bos if specials else []) + [int(i) for i in self.tok.encode(text)]

    def decode(self, ids) -> str:
        if self.backend is not None:
            return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)
        return self.tok.decode(ids)


@contextlib.contextmanager
def _one_line_on_lm_eval_command_line():
    """lm_eval's command line prints an exception from a model's constructor with its
    traceback; there a bad run or model_arg is one `jaxllm:` line and exit 2 instead (a
    SystemExit, which lm_eval lets through). Called from Python, the ConfigError propagates."""
    try:
        yield
    except ConfigError as e:
        if "lm_eval._cli" not in sys.modules:  # loaded by `lm_eval` and `python -m jaxllm.harness`
            raise
        print(f"jaxllm: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


class JaxllmLM(TemplateLM):
    """A jaxllm run as an lm_eval model (see the module docstring for `model_args`)."""

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        with _one_line_on_lm_eval_command_line():
            return super().create_from_arg_string(arg_string, additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        with _one_line_on_lm_eval_command_line():
            return super().create_from_arg_obj(arg_dict, additional_config)

    def __init__(
        self,
        run=None,
        checkpoint="last",
        batch_size=8,
        max_length=None,
        max_gen_toks=256,
        device=None,
        max_batch_size=None,
        **overrides,
    ):
        super().__init__()
        del device, max_batch_size  # lm_eval's: the run's mesh places the model
        if run is None:
            raise ConfigError("model_args needs run=RUN_DIR, a jaxllm run directory.")
        unknown = sorted(k for k in overrides if "." not in k)
        if unknown:
            raise ConfigError(
                f"model_args {unknown[0]} is not a jaxllm model argument; use run, checkpoint, "
                "batch_size, max_length, max_gen_toks or a run key such as generate.kv_group."
            )
        self.batch = _positive("batch_size", batch_size)
        self._max_gen_toks = _positive("max_gen_toks", max_gen_toks)
        path = fetched(check_url(str(run), "run"), "run")
        resolve(path)  # ConfigError when it is not a run or a checkpoint
        r = restore(path, [f"{k}={v}" for k, v in overrides.items()], which=str(checkpoint))
        self.cfg, self.mesh, self.step = r.cfg, r.mesh, r.step
        self.model = r.model()
        self._graphdef, self._state = nnx.split(self.model)
        limit = self.cfg.model.max_seq_len
        self._max_length = limit if max_length is None else _positive("max_length", max_length)
        if self._max_length > limit:
            raise ConfigError(
                f"model_args max_length={self._max_length} exceeds the run's model.max_seq_len "
                f"({limit})."
            )
        self.text = _Text(self.cfg.data)
        tok = self.text.tok
        if tok.eos_id is None:
            raise ConfigError(f"the run's tokenizer ({tok.name}) has no EOS token for lm_eval.")
        self.stops = sorted(
            {tok.eos_id, *generation_stop_ids(generation_config(self.cfg.data.tokenizer, path))}
        )

    @property
    def eot_token_id(self) -> int:
        return self.text.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.text.tok.bos_id
        return bos if bos is not None else self.text.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        return self.text.encode(string, add_special_tokens is not False)

    def tok_decode(self, tokens) -> str:
        return self.text.decode(tokens)

    def _score_rows(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(log-probability, is-argmax) [rows, T-1] of each row's tokens after its first."""
        longest = max(len(r) for r in rows) - 1
        t = min(max(MIN_BUCKET, 1 << (longest - 1).bit_length()), self._max_length)
        tokens = np.zeros((self.batch, t), np.int32)
        targets = np.zeros((self.batch, t), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r) - 1], targets[i, : len(r) - 1] = r[:-1], r[1:]
        with sharding.active(sharding.Parallel(self.mesh)):
            logp, greedy = _token_scores(self._graphdef, self._state, tokens, targets)
        return np.asarray(logp)[: len(rows)], np.asarray(greedy)[: len(rows)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of the continuation's log-probabilities, whether each of its tokens is the
        argmax) per (key, context ids, continuation ids), longest first in batches."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch):
            chunk = order[start : start + self.batch]
            rows, spans = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                if not continuation:
                    raise ValueError("lm_eval asked for the likelihood of an empty continuation")
                whole = (list(context) + list(continuation))[-(self._max_length + 1) :]
                rows.append(whole)
                spans.append((len(whole) - 1 - len(continuation), len(whole) - 1))
            logp, greedy = self._score_rows(rows)
            for k, (i, (a, b)) in enumerate(zip(chunk, spans)):
                out[i] = (float(logp[k, a:b].sum()), bool(greedy[k, a:b].all()))
                self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for window in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length,
                context_len=1,
            ):
                windows.append((None, *lm_utils.make_disjoint_window(window)))
                owners.append(n)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owners, scores):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id]) or None
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self._max_gen_toks)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ConfigError(
                    "jaxllm answers lm_eval's generate_until greedily; this task samples "
                    "(do_sample / temperature > 0)."
                )
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            new = int(kwargs["max_gen_toks"])
            if new >= self._max_length:
                raise ConfigError(
                    f"max_gen_toks ({new}) must be below max_length ({self._max_length})."
                )
            prompts = []
            for i in indices:
                ids = self.tok_encode(requests[i].args[0])[-(self._max_length - new) :]
                prompts.append(ids or [self.prefix_token_id])
            gen = dataclasses.replace(
                self.cfg.generate, max_new_tokens=new, temperature=0.0, top_k=0, top_p=1.0
            )
            stop_seqs = [self.tok_encode(s, False) for s in until if s]
            result = engine_batch.generate(
                self.model,
                prompts,
                gen,
                stop_tokens=self.stops,
                stop_sequences=[s for s in stop_seqs if s],
                mesh=self.mesh,
                mesh_config=self.cfg.mesh,
                slots=self.batch,
                max_len=self._max_length,
            )
            for k, i in enumerate(indices):
                ends = result.ends[k] if result.ends else []
                text = self.tok_decode([*result.tokens[k], *ends])
                out[i] = postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out


def evaluate_run(
    path,
    overrides=(),
    tasks: str = "",
    *,
    include_path=None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    which: str = "last",
) -> dict:
    """lm_eval's `simple_evaluate` of a run on comma-separated `tasks` (names, globs or task
    YAML files; `include_path`: a directory of more task YAMLs). A path that is not a run and
    unknown tasks are a ConfigError before the weights are loaded."""
    from pathlib import Path

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    resolve(fetched(check_url(str(path), "RUN_DIR"), "RUN_DIR"))  # a run, before lm_eval's index
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path} is not a directory of task YAMLs.")
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ConfigError("--harness needs task names, e.g. --harness hellaswag,arc_easy.")
    for name in names:
        if not manager.match_tasks([name]) and not Path(name).is_file():
            raise ConfigError(
                f"lm_eval knows no task {name!r}; list them with `lm_eval ls tasks`, or give "
                "--include-path DIR for task YAMLs of your own."
            )
    run_keys = dict(o.split("=", 1) for o in overrides)
    lm = JaxllmLM(run=path, checkpoint=which, **run_keys)
    return simple_evaluate(
        model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot
    )


def cmd_harness(ns) -> int:
    """`jaxllm eval RUN --harness TASKS`: lm_eval's results table on stdout."""
    from lm_eval.utils import make_table

    path, overrides = split_args(ns.args)
    results = evaluate_run(
        path,
        overrides,
        ns.harness,
        include_path=ns.include_path,
        limit=ns.limit,
        num_fewshot=ns.num_fewshot,
        which=ns.checkpoint,
    )
    print(make_table(results))
    return 0


# Registered by the importable module only: `python -m jaxllm.harness` runs a second copy as
# __main__, and lm_eval's registry holds one class per name (the installed .pth hook's
# placeholder, "jaxllm.harness:JaxllmLM", upgrades to this class).
if __name__ == "jaxllm.harness":
    register_model("jaxllm")(JaxllmLM)


def main(argv: list[str] | None = None) -> int:
    """lm_eval's command line with the `jaxllm` model type registered; a jaxllm ConfigError is
    one line on stderr and exit 2."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except ConfigError as e:
        print(f"jaxllm: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from jaxllm.harness import main as _main  # the registered module's copy

    sys.exit(_main())
