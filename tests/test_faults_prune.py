"""Bad input of `jaxllm prune`: an unknown method, a sparsity outside [0, 1), neither a
sparsity nor a pattern, a malformed pattern, N not below M, a pattern whose M does not divide a
weight's input channels, a sparsity that contradicts the pattern, calibration options for
magnitude, too few calibration tokens, a quantized source, layers that cannot be removed
(none at that sparsity, a pattern, an MoE stack), heads or channels that cannot be (none at
that sparsity: heads go a whole GQA group at a time; MLA; routed experts), SliceGPT of a model
it cannot rotate or at a sparsity that slices nothing, and an existing OUT.

As in test_faults.py, every row runs one command on a copy of the shared small run and asserts
the exit code, exactly one `jaxllm:` line naming the problem, no traceback, and unchanged run
and scratch directories: nothing written.
"""

from __future__ import annotations

import pytest
from test_faults import Case
from test_faults_quantize import check_fault

from jaxllm.cli import main


def _prune(*options, out="out"):
    return lambda r, t: ["prune", str(r), str(t / out), *options]


def _existing_out(run, tmp) -> None:
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine\n")


CASES = [
    Case(
        "unknown-method",
        _prune("--method", "obs", "--sparsity", "0.5"),
        2,
        "method (--method) obs is not a pruning method jaxllm has; it has magnitude, wanda, sparsegpt",
    ),
    Case("sparsity-one", _prune("--method", "magnitude", "--sparsity", "1"), 2, "outside [0, 1)"),
    Case(
        "negative-sparsity",
        _prune("--method", "magnitude", "--sparsity", "-0.1"),
        2,
        "sparsity (--sparsity) -0.1 is outside [0, 1)",
    ),
    Case(
        "no-sparsity-or-pattern",
        _prune("--method", "magnitude"),
        2,
        "pruning needs a sparsity (--sparsity, a fraction in [0, 1)) or a pattern N:M (--pattern)",
    ),
    Case(
        "malformed-pattern",
        _prune("--method", "magnitude", "--pattern", "2-4"),
        2,
        "--pattern '2-4': give N:M, such as 2:4 or 4:8",
    ),
    Case(
        "n-not-below-m",
        _prune("--method", "magnitude", "--pattern", "4:4"),
        2,
        "--pattern 4:4: N must be below M",
    ),
    Case(
        "pattern-does-not-divide",
        _prune("--method", "wanda", "--pattern", "2:5"),
        2,
        "--pattern 2:5: M=5 does not divide the 64 input channels of layers/attn/k_proj",
    ),
    Case(
        "sparsity-against-pattern",
        _prune("--method", "magnitude", "--pattern", "2:4", "--sparsity", "0.6"),
        2,
        "pattern (--pattern) 2:4 zeroes 0.5 of each weight; drop sparsity (--sparsity) 0.6",
    ),
    Case(
        "calibration-for-magnitude",
        _prune("--method", "magnitude", "--sparsity", "0.5", "--samples", "8"),
        2,
        "method (--method) magnitude reads no calibration data (calibration, samples: --calibration",
    ),
    Case(
        "too-few-calibration-tokens",
        _prune("--method", "sparsegpt", "--sparsity", "0.5", "--samples", "100000"),
        2,
        "--samples 100000 needs 6400000: pass more data or fewer --samples",
    ),
    Case(
        "a-quantized-source",
        lambda r, t: [
            "prune",
            str(t / "q"),
            str(t / "out"),
            "--method",
            "magnitude",
            "--sparsity",
            "0.5",
        ],
        2,
        "is quantized (quantize.method=rtn); prune the run it was quantized from",
        setup=lambda r, t: main(["quantize", str(r), str(t / "q"), "--method", "rtn"]),
    ),
    Case(
        "layers-removes-none",
        _prune("--method", "layers", "--sparsity", "0.2"),
        2,
        "--sparsity 0.2 removes no layer of 2 (floor(0.2 x 2) = 0)",
    ),
    Case(
        "layers-with-a-pattern",
        _prune("--method", "layers", "--pattern", "2:4"),
        2,
        "--method layers removes whole parts: it takes no --pattern",
    ),
    Case(
        "layers-of-an-moe-model",
        _prune("--method", "layers", "--sparsity", "0.5", "model.moe.num_experts=4"),
        2,
        "--method layers removes layers of a stack whose layers are all alike",
    ),
    Case(
        "heads-removes-no-group",
        _prune("--method", "heads", "--sparsity", "0.4"),
        2,
        "--sparsity 0.4 removes no head group: the model's 4 query heads read 2 key-value heads",
    ),
    Case(
        "heads-of-an-mla-model",
        _prune(
            "--method",
            "heads",
            "--sparsity",
            "0.5",
            "model.num_kv_heads=4",
            "model.mla.kv_lora_rank=16",
        ),  # fmt: skip
        2,
        "--method heads prunes the key-value head groups of standard attention; this model has MLA",
    ),
    Case(
        "channels-removes-none",
        _prune("--method", "channels", "--sparsity", "0.005"),
        2,
        "--sparsity 0.005 removes no channel of model.mlp_dim 128",
    ),
    Case(
        "channels-of-an-moe-model",
        _prune("--method", "channels", "--sparsity", "0.5", "model.moe.num_experts=4"),
        2,
        "this model has routed experts",
    ),
    Case(
        "slicegpt-of-an-moe-model",
        _prune("--method", "slicegpt", "--sparsity", "0.25", "model.moe.num_experts=4"),
        2,
        "--method slicegpt rotates the residual stream of a pre-norm RMSNorm decoder; this "
        "model has routed experts",
    ),
    Case(
        "slicegpt-slices-nothing",
        _prune("--method", "slicegpt", "--sparsity", "0.01"),
        2,
        "--sparsity 0.01 slices no channel of model.d_model 64",
    ),
    Case(
        "existing-out",
        _prune("--method", "magnitude", "--sparsity", "0.5"),
        2,
        "OUT",
        setup=_existing_out,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, small_run, tmp_path, capsys):
    check_fault(case, small_run, tmp_path, capsys)
