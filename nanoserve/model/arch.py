"""The shape of a supported model, read from `config.json` or from GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nanoserve.model.gemma4_arch import Gemma4Layers, gemma4_from_gguf, gemma4_from_hf
from nanoserve.model.gpt_oss_arch import GptOssExperts, gpt_oss_from_gguf, gpt_oss_from_hf
from nanoserve.model.linear_arch import (
    LINEAR,
    LinearAttentionConfig,
    gguf_num_layers,
    hybrid_from_gguf,
    hybrid_from_hf,
)
from nanoserve.model.moe_arch import MoeConfig, moe_from_gguf, moe_from_hf
from nanoserve.model.rope_scaling import (  # (RopeScaling, the error: importable from here too)
    RopeScaling,
    UnsupportedModelError,
    gguf_rope_scaling,
    rope_scaling_of,
    yarn_mscale,
)

__all__ = ["FULL", "SLIDING", "ArchConfig", "RopeScaling", "UnsupportedModelError",
           "yarn_mscale"]

# Hugging Face `model_type` -> our family. Mistral is Llama without qkv bias, every layer in
# its sliding window; Gemma 3's layers alternate windowed and global attention.
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # a multimodal config whose text model runs alone (text_config)
    "gemma4_text": "gemma4",  # Gemma 3's layer and more (gemma4_arch.py)
    "gemma4": "gemma4",  # a multimodal config whose text model runs alone (text_config)
    "gpt_oss": "gpt_oss",  # sinks, biases, experts with a clamped SwiGLU (gpt_oss_arch.py)
    # mixture of experts: the family's attention, the experts in `ArchConfig.moe`
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen3",
    # hybrids: Gated DeltaNet layers between gated full-attention ones (linear_arch.py)
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",  # a multimodal config whose text model runs alone (text_config)
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_next": "qwen3_5",  # Qwen3-Next: the same layers, its projections fused by head
}
# a multimodal config -> its text model's type
TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen3_5": "qwen3_5_text",
                    "qwen3_5_moe": "qwen3_5_moe_text"}
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' `layer_types` values
# Gemma 3's layers without `layer_types`: five windowed, then one global, repeating
GEMMA3_SLIDING_PATTERN = 6
@dataclass(frozen=True)
class ArchConfig:
    """Hyperparameters of a decoder: the Llama family (Llama 2/3, Mistral, SmolLM2), Qwen2,
    Qwen3 and Gemma 3, with per-layer properties (`layer_window`) where layers differ."""

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qkv_bias: bool
    has_qk_norm: bool
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # per layer, SLIDING or FULL; () is every layer FULL, or every layer SLIDING where a
    # sliding_window is given (Mistral)
    layer_types: tuple[str, ...] = ()
    # Gemma 3: the windowed layers' own RoPE base (unscaled), norms after the attention and
    # the MLP too ("sandwich"), GELU-tanh gating, the embedding scaled by sqrt(hidden_size),
    # and the query scale 1 / sqrt(query_pre_attn_scalar)
    rope_local_theta: float | None = None
    has_sandwich_norms: bool = False
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    scales_embedding: bool = False
    query_pre_attn_scalar: float | None = None
    moe: MoeConfig | None = None  # a mixture-of-experts model's experts (moe_arch.py)
    # a hybrid's Gated DeltaNet layers (LINEAR in layer_types; linear_arch.py), and its full
    # attention layers' output gate (sigmoid(gate) * attention, the gate from q_proj) and
    # rotary share (RoPE on the first partial_rotary_factor of each head's dims)
    linear: LinearAttentionConfig | None = None
    has_attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    # multimodal RoPE (Qwen3.5): the rotary pairs of each of the (t, h, w) position axes,
    # interleaved (pair j turns with axis j % 3 within its sections) or in runs; () for 1-D
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    # Gemma 4: per-layer head shapes, KV sharing, per-layer embeddings, ... (gemma4_arch.py);
    # `head_dim` and `num_kv_heads` are then its windowed layers'
    gemma4: Gemma4Layers | None = None
    # gpt-oss: its experts (the layer's sinks and biases come with the family; gpt_oss_arch.py)
    gpt_oss: GptOssExperts | None = None

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.gemma4 is None else self.gemma4.head_dims[layer]

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_kv_heads if self.gemma4 is None else self.gemma4.kv_heads[layer]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attends_images_both_ways(self) -> bool:
        """Whether an image's placeholder tokens attend each other both ways (Gemma 3:
        transformers' `token_type_ids` mask), not only causally."""
        return self.family == "gemma3"

    @property
    def norms_are_offsets(self) -> bool:
        """The checkpoint's RMSNorm weights w are used as 1 + w (Gemma, Qwen3.5)."""
        return self.family in ("gemma3", "qwen3_5")

    def is_linear(self, layer: int) -> bool:
        """Layer `layer` is a Gated DeltaNet layer (no KV cache: a state per sequence)."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_linear(i))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_linear(i))

    @property
    def rotary_dim(self) -> int:
        """The dims of a head RoPE turns (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int:
        """The keys layer `layer` attends: its sliding window, or 0 for the whole context."""
        if not self.sliding_window:
            return 0
        is_sliding = not self.layer_types or self.layer_types[layer] == SLIDING
        return self.sliding_window if is_sliding else 0

    @property
    def has_windows(self) -> bool:
        return any(self.layer_window(i) for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        """What q · k is multiplied by: 1 / sqrt(head_dim), or Gemma's query_pre_attn_scalar."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def active_intermediate_size(self) -> int:
        """The MLP rows a token runs through, averaged over the layers (a MoE layer's k
        experts and shared expert; `intermediate_size` in a dense model)."""
        if self.moe is None:
            return self.intermediate_size
        return self.moe.active_intermediate_size(self.intermediate_size, self.num_layers)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ArchConfig:
        """Read a Hugging Face `config.json` dict; refuse what we cannot run, saying why."""
        model_type = cfg.get("model_type", "")
        if model_type in TEXT_MODEL_TYPES and "text_config" in cfg:  # a VLM's text half
            return cls.from_hf_config({**cfg["text_config"],
                                       "model_type": TEXT_MODEL_TYPES[model_type],
                                       "architectures": cfg.get("architectures")})
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures") or [model_type]
            raise UnsupportedModelError(
                f"unsupported architecture {archs[0]!r} (model_type={model_type!r}); "
                f"nanoserve runs model types {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "gpt_oss":  # (its MXFP4 experts are read as they are)
            return cls(**gpt_oss_from_hf(cfg))
        if cfg.get("quantization_config"):
            method = cfg["quantization_config"].get("quant_method", "unknown")
            raise UnsupportedModelError(
                f"quantized checkpoints are not supported (quant_method={method!r}); "
                "use an unquantized checkpoint or a GGUF file"
            )
        family = SUPPORTED_MODEL_TYPES[model_type]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if family == "gemma3":
            return _gemma3_from_hf(cfg, num_heads, head_dim, eos_ids)
        if family == "gemma4":
            return _gemma4_from_hf(cfg, eos_ids)
        hybrid = hybrid_from_hf(cfg) if family == "qwen3_5" else {}
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            # (a MoE model with no dense layer gives none: its experts' size stands in)
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            has_qkv_bias=(bool(family == "qwen2" and cfg.get("qkv_bias", True))
                          or bool(cfg.get("attention_bias", False))),
            has_qk_norm=family in ("qwen3", "qwen3_5"),
            rope_scaling=rope_scaling_of(cfg),
            sliding_window=window if family == "llama" else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=moe_from_hf(cfg),
            **hybrid,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], has_output_weight: bool,
                           tensor_shapes: Mapping[str, tuple[int, ...]] | None = None
                           ) -> ArchConfig:
        """Read the `{arch}.*` keys of a GGUF file (llama.cpp's names for the same numbers);
        `tensor_shapes` (the file's, by name) tell a MoE file's MoE layers (moe_arch.py)."""
        arch = meta.get("general.architecture", "")
        families = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
                    "gemma4": "gemma4", "gpt-oss": "gpt_oss",
                    "qwen2moe": "qwen2", "qwen3moe": "qwen3",
                    "qwen35": "qwen3_5", "qwen35moe": "qwen3_5"}
        if arch not in families:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r}; nanoserve runs {sorted(families)}"
            )

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        num_heads = get("attention.head_count")
        hidden = get("embedding_length")
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = gguf_rope_scaling(get)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        gemma = _gemma3_from_gguf(get) if arch == "gemma3" else {}
        hybrid = hybrid_from_gguf(get, hidden // num_heads) if arch in ("qwen35", "qwen35moe") \
            else {}
        num_layers = gguf_num_layers(get)  # (a file's MTP blocks follow its decoder layers)
        fields: dict[str, Any] = dict(
            family=families[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            # (a MoE file with no dense layer may give none: its experts' size stands in)
            intermediate_size=get("feed_forward_length") or get("expert_feed_forward_length"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=get("attention.head_count_kv") or num_heads,
            head_dim=get("attention.key_length") or hidden // num_heads,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=get("context_length", 4096),
            tie_word_embeddings=not has_output_weight,
            has_qkv_bias=families[arch] == "qwen2",
            has_qk_norm=families[arch] in ("qwen3", "gemma3", "gemma4", "qwen3_5"),
            rope_scaling=scaling,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            **gemma,
            **hybrid,
            moe=(moe_from_gguf(meta, num_layers, tensor_shapes)
                 if arch not in ("gemma4", "gpt-oss") else None),
        )
        if arch == "gpt-oss":
            fields.update(gpt_oss_from_gguf(get, num_layers))
        if arch == "gemma4":
            fields.update(_gemma4_from_gguf(get, num_layers, tensor_shapes))
        return cls(**fields)


def _gemma3_from_hf(cfg: dict[str, Any], num_heads: int, head_dim: int,
                    eos_ids: tuple[int, ...]) -> ArchConfig:
    """Gemma 3's text model from its config.json (transformers' Gemma3TextConfig defaults)."""
    num_layers = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") \
        or GEMMA3_SLIDING_PATTERN
    layer_types = tuple(cfg.get("layer_types") or gemma3_layer_types(num_layers, pattern))
    params = cfg.get("rope_parameters") or {}
    full = params.get(FULL) if isinstance(params.get(FULL), dict) else None
    local = params.get(SLIDING) if isinstance(params.get(SLIDING), dict) else None
    global_cfg = {**cfg, "rope_parameters": full} if full else cfg
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"unsupported Gemma 3 activation {act!r}; nanoserve runs "
                                    "'gelu_pytorch_tanh'")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            raise UnsupportedModelError(f"Gemma 3 with {key}={cfg[key]} is not supported")
    return ArchConfig(
        family="gemma3", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float((full or {}).get("rope_theta") or cfg.get("rope_theta") or 1e6),
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True), has_qkv_bias=bool(
            cfg.get("attention_bias", False)), has_qk_norm=True,
        rope_scaling=rope_scaling_of(global_cfg), sliding_window=cfg.get("sliding_window", 4096),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, layer_types=layer_types,
        rope_local_theta=float((local or {}).get("rope_theta")
                               or cfg.get("rope_local_base_freq") or 10000.0),
        has_sandwich_norms=True, hidden_act="gelu_tanh", scales_embedding=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256))


def _gemma4_from_gguf(get: Any, num_layers: int,
                      tensor_shapes: Mapping[str, tuple[int, ...]] | None) -> dict[str, Any]:
    """The ArchConfig fields of llama.cpp's gemma4 keys (gemma4_arch.py) beyond the common."""
    return {**_gemma3_from_gguf(get), "query_pre_attn_scalar": None,
            **gemma4_from_gguf(get, num_layers, tensor_shapes)}


def _gemma3_from_gguf(get: Any) -> dict[str, Any]:
    """The ArchConfig fields llama.cpp's gemma3 keys give, or its built-in values where the
    file has no key (a window on five layers of six, local RoPE base 10k, query scale by the
    key length)."""
    num_layers = int(get("block_count"))
    window = get("attention.sliding_window")
    return {"layer_types": gemma3_layer_types(num_layers, GEMMA3_SLIDING_PATTERN),
            "sliding_window": None if window is None else int(window),
            "rope_local_theta": 10000.0, "has_sandwich_norms": True, "hidden_act": "gelu_tanh",
            "scales_embedding": True, "query_pre_attn_scalar": float(
                get("attention.key_length") or get("embedding_length")
                // get("attention.head_count"))}


def _gemma4_from_hf(cfg: dict[str, Any], eos_ids: tuple[int, ...]) -> ArchConfig:
    """Gemma 4's text model: Gemma 3's (plain-w norms, no query scale: its attention scale is
    1) with the layer shapes of gemma4_arch.py."""
    num_layers = cfg["num_hidden_layers"]
    layer_types = tuple(cfg.get("layer_types") or gemma3_layer_types(num_layers,
                                                                     GEMMA3_SLIDING_PATTERN))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"unsupported Gemma 4 activation {act!r}; nanoserve runs "
                                    "'gelu_pytorch_tanh'")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("Gemma 4 with attention biases is not supported")
    return ArchConfig(
        family="gemma4", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=num_layers,
        num_heads=cfg["num_attention_heads"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True), has_qkv_bias=False,
        has_qk_norm=True, sliding_window=cfg.get("sliding_window", 512),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, layer_types=layer_types,
        has_sandwich_norms=True, hidden_act="gelu_tanh", scales_embedding=True,
        **gemma4_from_hf(cfg, layer_types))


def gemma3_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Every `pattern`-th layer global, the others windowed (transformers' default)."""
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
