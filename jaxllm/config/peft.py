"""The `peft` section: parameter-efficient fine-tuning (LoRA, QLoRA, bottleneck adapters,
prompt tuning)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxllm.config.errors import fail

# The weights LoRA can adapt, by name: the attention and MLP projections (dense and shared
# experts), the routed experts' projections (`experts` names all three), MLA's projections, and
# the untied LM head. `all-linear` (as in Hugging Face PEFT) is every one but the LM head.
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "experts",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj",
    "kv_b_proj",
    "lm_head",
)
ALL_LINEAR = "all-linear"
# The vision tower's weights (`model.vision`), named with the prefix `visual.`: its blocks'
# projections, the merger's two layers (fc1, fc2) and the patch embedding. A name without the
# prefix adapts the language model only; `visual.all-linear` is every one but patch_embed.
VISION = "visual."
VISION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VISION_TARGETS += ("fc1", "fc2", "patch_embed")
# Whole modules that can train beside LoRA adapters (PEFT's modules_to_save), by PEFT's names:
# the token embeddings, the untied LM head, a reward model's score head.
SAVABLE = ("embed_tokens", "lm_head", "score")


@dataclasses.dataclass(frozen=True)
class PeftConfig:
    """Train a few parameters on top of a frozen base: LoRA adapters (`lora`), LoRA on a base
    stored in 4-bit NormalFloat (`qlora`), Houlsby bottleneck adapters after every block's
    attention and MLP (`adapter`), or soft-prompt embeddings (`prompt`). The base comes from
    `checkpoint.init_from` (else the seed's random initialisation); gradients and optimizer
    state exist only for what trains, and checkpoints hold only that."""

    method: Literal["none", "lora", "qlora", "adapter", "prompt"] = "none"
    """`none` trains every parameter (pretraining, full fine-tuning)."""
    rank: int = 8
    """LoRA rank r: each adapted weight W gets W + (alpha / r) * A B with A [in, r], B [r, out]."""
    alpha: float = 16.0
    """LoRA alpha: the adapters' output is scaled by alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.0
    """Dropout on the input of the adapters (training only), as Hugging Face PEFT's
    lora_dropout; under `adapter`, on the input of each bottleneck. The routed experts' LoRA
    adapters are merged into their weights (W + s A B), where there is no separate input to
    drop, so they take none."""
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    """Which weights get adapters, by name: q_proj k_proj v_proj o_proj gate_proj up_proj
    down_proj (a name matches the dense and the expert weight of that name), experts (all
    routed expert projections), q_a_proj q_b_proj kv_a_proj kv_b_proj (MLA), lm_head, or
    all-linear (every one of them but lm_head): the language model's. The vision tower's
    (`model.vision`) take the prefix `visual.`: visual.q_proj .. visual.down_proj (its blocks),
    visual.fc1 visual.fc2 (the merger), visual.patch_embed, or visual.all-linear (all but
    patch_embed)."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023) instead of alpha / r."""
    keep_zeros: bool = False
    """LoRA on a pruned base: the update keeps the base's zeros, each adapted layer computing
    x (W + s (A B) * [W != 0]) (the masked update as a dense weight), so the merged model has
    the pruned run's sparsity. Set by itself when `checkpoint.init_from` is a run pruned to
    zeros (`jaxllm prune`, unstructured or N:M)."""
    dora: bool = False
    """DoRA (Liu et al. 2024; PEFT's use_dora): each adapted weight becomes
    m * (W + s A B) / ||W + s A B||, the norm per output over the inputs (taken as a constant,
    as PEFT), with the trained magnitude m starting at the base's norms. Not with keep_zeros."""
    modules_to_save: tuple[str, ...] = ()
    """Whole weights that train in full beside the LoRA adapters and are stored with them
    (PEFT's modules_to_save): embed_tokens (with tied embeddings, also the LM head), lm_head
    (untied only), score (a reward model's head)."""
    layers_to_transform: tuple[int, ...] = ()
    """Adapt only these layers (PEFT's layers_to_transform; empty: all). The other layers'
    A and B start at zero, where LoRA's gradients are zero too, so they stay off. Not with
    dora, and only on a model with one stack of layers (no MoE or hybrid pattern)."""
    num_virtual_tokens: int = 20
    """Prompt tuning: trainable embeddings placed before every example."""
    adapter_size: int = 64
    """Bottleneck adapters: the width m of each bottleneck, h + up(act(down(h))) with down
    [d_model, m] and up [m, d_model] (Houlsby et al. 2019 use 8 to 256)."""
    adapter_activation: Literal["relu", "gelu", "silu", "tanh"] = "silu"
    """Bottleneck adapters: the nonlinearity between down and up (gelu is the exact, erf one;
    silu, also called swish, is the adapters library's choice for Houlsby's configuration)."""

    def validate(self) -> None:
        if self.keep_zeros and not self.lora:
            fail(
                f"peft.keep_zeros masks a LoRA update; peft.method={self.method} has none "
                "(a full run from a pruned run keeps its zeros by itself)."
            )
        if self.dora and not self.lora:
            fail(f"peft.dora decomposes a LoRA update; peft.method={self.method} has none.")
        if self.dora and self.keep_zeros:
            fail(
                "peft.dora rescales whole columns of the weight, which peft.keep_zeros's masked "
                "update cannot hold; set one of them."
            )
        if self.modules_to_save and not self.lora:
            fail(
                f"peft.modules_to_save trains whole modules beside LoRA adapters; "
                f"peft.method={self.method} has none (full fine-tuning trains every module)."
            )
        if self.layers_to_transform and not self.lora:
            fail(
                f"peft.layers_to_transform picks LoRA's layers; peft.method={self.method} has none."
            )
        if self.layers_to_transform and self.dora:
            fail(
                "peft.layers_to_transform keeps the other layers' adapters at zero, where DoRA's "
                "magnitude would still train; set one of them."
            )
        if any(i < 0 for i in self.layers_to_transform):
            fail(
                f"peft.layers_to_transform: layer numbers are >= 0, not {list(self.layers_to_transform)}."
            )
        for name in self.modules_to_save:
            if name not in SAVABLE:
                fail(
                    f"peft.modules_to_save: {name!r} is not a module jaxllm can train beside "
                    f"LoRA; use {', '.join(SAVABLE)}."
                )
            if name in self.targets:
                fail(f"peft.modules_to_save: {name!r} is also in peft.targets; name it once.")
        if self.method == "none":
            return
        if self.method == "prompt":
            if self.num_virtual_tokens < 1:
                fail(f"peft.num_virtual_tokens must be >= 1, not {self.num_virtual_tokens}.")
            return
        if not 0 <= self.dropout < 1:
            fail(f"peft.dropout must be in [0, 1), not {self.dropout}.")
        if self.method == "adapter":
            if self.adapter_size < 1:
                fail(f"peft.adapter_size must be >= 1, not {self.adapter_size}.")
            return
        if self.rank < 1:
            fail(f"peft.rank must be >= 1, not {self.rank}.")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            fail(f"peft.alpha must be a finite number > 0, not {self.alpha}.")
        if not self.targets:
            fail("peft.targets is empty; name the weights to adapt, e.g. [q_proj, v_proj].")
        for name in self.targets:
            tower = name.startswith(VISION) and name[len(VISION) :] in (*VISION_TARGETS, ALL_LINEAR)
            if name not in (*LORA_TARGETS, ALL_LINEAR) and not tower:
                fail(
                    f"peft.targets: {name!r} is not a weight LoRA can adapt; use "
                    f"{', '.join(LORA_TARGETS)} or {ALL_LINEAR}, or for the vision tower "
                    f"{VISION}NAME with NAME one of {', '.join(VISION_TARGETS)}, {ALL_LINEAR}."
                )

    @property
    def virtual_tokens(self) -> int:
        """The soft prompt's length: num_virtual_tokens under prompt tuning, else 0."""
        return self.num_virtual_tokens if self.method == "prompt" else 0

    @property
    def bottleneck(self) -> bool:
        """Whether this is a bottleneck-adapter run (`adapter`), whose adapters are layers of
        their own: nonlinear, they merge into no weight."""
        return self.method == "adapter"

    @property
    def lora(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def scale(self) -> float:
        """The factor on the adapters' output."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def targeted(self, name: str, expert: bool, tower: bool = False) -> bool:
        """Whether the weight `name` (a routed expert's when `expert`; the vision tower's when
        `tower`) gets an adapter."""
        if not self.lora:
            return False
        if tower:
            wanted = {t[len(VISION) :] for t in self.targets if t.startswith(VISION)}
            if ALL_LINEAR in wanted:
                return name in VISION_TARGETS and name != "patch_embed"
            return name in wanted and name in VISION_TARGETS
        wanted = set(self.targets)
        if name not in LORA_TARGETS:
            return False
        if ALL_LINEAR in wanted:
            return name != "lm_head"
        return name in wanted or (expert and "experts" in wanted)
