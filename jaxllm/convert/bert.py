"""BERT (`bert`) and RoBERTa (`roberta`): bidirectional encoders (`model.kind=encoder`) of
post-LayerNorm blocks with biases everywhere and an exact-GELU MLP, learned absolute positions,
token-type embeddings and an embedding LayerNorm, and the MLM head (dense, GELU, LayerNorm, the
word embeddings as decoder, a vocabulary bias); the pooler when the file has one
(`BertForPreTraining`, `BertModel` files). The NSP head (`cls.seq_relationship`) is not part of
the model and is left unread.

RoBERTa is BERT's layout under other names, with one difference of substance: its position ids
start at padding_idx + 1 (transformers' `create_position_ids_from_input_ids`), so the table has
max_position_embeddings = 514 rows for 512 tokens and position p reads row p + pad_token_id + 1
(`model.encoder.position_offset`). Padding tokens get row padding_idx there; here their outputs
are whatever segment id 0 makes them (they see only padding), so only real tokens compare.

transformers ties the decoder's weight to the word embeddings and its bias to
`cls.predictions.bias` / `lm_head.bias`; files store the decoder only when untied (older files
store the tied copies too, which import leaves unread).
"""

from __future__ import annotations

from jaxllm.config import ModelConfig
from jaxllm.convert.config_map import _activation, _dtype_name, _fail
from jaxllm.convert.links import Family, Link


def _model(hf: dict, roberta: bool) -> dict:
    if hf.get("position_embedding_type", "absolute") != "absolute":
        _fail(
            f"position_embedding_type={hf['position_embedding_type']!r} (relative positions) is "
            "not supported; jaxllm's encoders take absolute learned positions."
        )
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        _fail("a BERT / RoBERTa decoder (is_decoder, add_cross_attention) is not supported.")
    offset = int(hf.get("pad_token_id", 1)) + 1 if roberta else 0
    return {
        "kind": "encoder",
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf["num_attention_heads"],
        "mlp_dim": hf["intermediate_size"],
        "max_seq_len": hf["max_position_embeddings"],
        "position": "learned",
        "norm": "layernorm",
        "norm_placement": "post",
        "norm_eps": float(hf.get("layer_norm_eps", 1e-12)),
        **_activation(hf.get("hidden_act", "gelu"), gated=False),
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "encoder": {
            "type_vocab_size": hf.get("type_vocab_size", 2),
            "embed_norm": True,
            "position_offset": offset,
            "mlm_head": True,
        },
    }


def _hf(cfg: ModelConfig, roberta: bool) -> dict:
    acts = {"gelu": "gelu_new" if cfg.gelu_approximate else "gelu", "relu": "relu"}
    enc = cfg.encoder
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": enc.type_vocab_size,
        "layer_norm_eps": cfg.norm_eps,
        "hidden_act": acts.get(cfg.mlp_activation, "gelu"),  # others: named by the check
        "position_embedding_type": "absolute",
        "tie_word_embeddings": cfg.tie_embeddings,
        # RoBERTa's position rows start after padding_idx: the offset names it
        "pad_token_id": max(enc.position_offset - 1, 0) if roberta else 0,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "dtype": _dtype_name(cfg),
    }


def _links(cfg: ModelConfig, prefix: str, head: dict[str, str]) -> list[Link]:
    """`head`: the MLM head's tensor names (transform dense, its norm, vocabulary bias,
    decoder), BERT's `cls.predictions.*` or RoBERTa's `lm_head.*`."""
    e, layer, attn = prefix + "embeddings.", prefix + "encoder.layer.{i}.", "layers/attn/"
    links = [
        Link(e + "word_embeddings.weight", ("embed/embedding",)),
        Link(e + "position_embeddings.weight", ("pos_embed",)),
        Link(e + "token_type_embeddings.weight", ("type_embed",)),
        Link(e + "LayerNorm.weight", ("embed_norm/scale",)),
        Link(e + "LayerNorm.bias", ("embed_norm/bias",)),
    ]
    for hf_name, x in (("query", "q"), ("key", "k"), ("value", "v")):
        links.append(
            Link(layer + f"attention.self.{hf_name}.weight", (attn + f"{x}_proj",), "linear")
        )
        links.append(Link(layer + f"attention.self.{hf_name}.bias", (attn + f"{x}_bias",), "flat"))
    links += [
        Link(layer + "attention.output.dense.weight", (attn + "o_proj",), "linear", n_in=2),
        Link(layer + "attention.output.dense.bias", (attn + "o_bias",)),
        Link(layer + "attention.output.LayerNorm.weight", ("layers/attn_norm/scale",)),
        Link(layer + "attention.output.LayerNorm.bias", ("layers/attn_norm/bias",)),
        Link(layer + "intermediate.dense.weight", ("layers/mlp/up_proj",), "linear"),
        Link(layer + "intermediate.dense.bias", ("layers/mlp/up_bias",)),
        Link(layer + "output.dense.weight", ("layers/mlp/down_proj",), "linear"),
        Link(layer + "output.dense.bias", ("layers/mlp/down_bias",)),
        Link(layer + "output.LayerNorm.weight", ("layers/mlp_norm/scale",)),
        Link(layer + "output.LayerNorm.bias", ("layers/mlp_norm/bias",)),
        Link(head["dense"] + ".weight", ("mlm_transform/dense/kernel",), "linear"),
        Link(head["dense"] + ".bias", ("mlm_transform/dense/bias",)),
        Link(head["norm"] + ".weight", ("mlm_transform/norm/scale",)),
        Link(head["norm"] + ".bias", ("mlm_transform/norm/bias",)),
        Link(head["bias"], ("lm_bias",)),
    ]
    if cfg.encoder.pooler:
        links.append(Link(prefix + "pooler.dense.weight", ("pooler/dense/kernel",), "linear"))
        links.append(Link(prefix + "pooler.dense.bias", ("pooler/dense/bias",)))
    if not cfg.tie_embeddings:
        links.append(Link(head["decoder"] + ".weight", ("lm_head",), "linear"))
    return links


def _family(name: str, architecture: str, prefix: str, head: dict[str, str]) -> Family:
    roberta = name == "roberta"
    decoder = head["decoder"]

    def skip(cfg: ModelConfig, tensor: str) -> bool:
        """Tied copies of the decoder, and the NSP head."""
        tied = tensor == decoder + ".weight" and cfg.tie_embeddings
        return tied or tensor == decoder + ".bias" or tensor.startswith("cls.seq_relationship.")

    return Family(
        name,
        architecture,
        lambda hf: _model(hf, roberta),
        lambda cfg: _hf(cfg, roberta),
        lambda cfg: _links(cfg, prefix, head),
        ignore=("embeddings.position_ids", "embeddings.token_type_ids"),
        skip=skip,
        file_fields=lambda names: {"encoder": {"pooler": prefix + "pooler.dense.weight" in names}},
    )


BERT = _family(
    "bert",
    "BertForMaskedLM",
    "bert.",
    {
        "dense": "cls.predictions.transform.dense",
        "norm": "cls.predictions.transform.LayerNorm",
        "bias": "cls.predictions.bias",
        "decoder": "cls.predictions.decoder",
    },
)
ROBERTA = _family(
    "roberta",
    "RobertaForMaskedLM",
    "roberta.",
    {
        "dense": "lm_head.dense",
        "norm": "lm_head.layer_norm",
        "bias": "lm_head.bias",
        "decoder": "lm_head.decoder",
    },
)
