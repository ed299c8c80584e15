"""Parameter groups `train.freeze` names, found by path in a model's parameter dict.

- `vision`: the vision tower (`visual`) without its merger; `projector`: the merger
  (`visual/merger`), which maps merged patches into the language model's width;
- `language`: the decoder: embeddings, blocks, final norm and LM head (not the heads new to a
  run: PPO's value head, a reward model's score, a soft prompt, distillation's projection);
- `embed`: the token (and position / type) embeddings; `head`: the untied LM head.

Under `peft` the parameter dict holds only what trains (the adapters), so a group freezes the
adapters inside it; a group holding none of them is refused, as one the model lacks.
"""

from __future__ import annotations

import jax

from jaxllm.config import ConfigError

_EMBED = ("embed", "pos_embed", "type_embed", "embed_norm")
_HEAD = ("lm_head", "lm_bias", "mlm_transform")
_NEW = ("value", "score", "score_bias", "distill_proj", "soft_prompt")


def groups_of(keys: tuple) -> set[str]:
    """The groups a parameter at dict path `keys` belongs to."""
    top = str(keys[0])
    if top == "visual":
        return {"projector"} if len(keys) > 1 and str(keys[1]) == "merger" else {"vision"}
    if top in _NEW:
        return set()
    return (
        {"language"}
        | ({"embed"} if top in _EMBED else set())
        | ({"head"} if top in _HEAD else set())
    )


def freeze_mask(params, freeze: tuple[str, ...], peft_method: str = "none"):
    """A tree of Python bools over `params` (a nested dict), True where a parameter is in a
    frozen group; None when nothing is frozen. ConfigError for a group that holds no
    parameter of `params`, or when nothing would be left to train."""
    if not freeze:
        return None
    found: set[str] = set()

    def one(path, _):
        groups = groups_of(tuple(getattr(k, "key", k) for k in path))
        found.update(groups)
        return bool(groups & set(freeze))

    mask = jax.tree_util.tree_map_with_path(one, params)
    missing = [g for g in freeze if g not in found]
    if missing:
        why = (
            f"under peft.method={peft_method} only the adapters train and none is in it"
            if peft_method != "none"
            else f"this model has none (it has {', '.join(sorted(found)) or 'no group'})"
        )
        raise ConfigError(
            f"train.freeze: {', '.join(missing)} holds no trainable parameter: {why}."
        )
    if all(jax.tree.leaves(mask)):
        raise ConfigError(
            f"train.freeze={list(freeze)} freezes every trainable parameter; leave one group out."
        )
    return mask
