"""GLMConfig: every knob of the shared model, with named presets.

litgpt-style: a dataclass whose attribute docstrings document each field. `GLMConfig.preset(name, **overrides)`
returns a validated config; `validate()` raises `ValueError` with a plain message for inconsistent settings so that
users see the problem at construction time instead of a shape error deep inside a forward pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from glm_lightning.tokenizer import ByteTokenizer

LAYER_KINDS = {"L": "KDA linear attention", "S": "DSA sparse attention"}
FFN_KINDS = ("moe", "dense")


@dataclass
class GLMConfig:
    """Configuration of :class:`glm_lightning.model.GLMModel`."""

    # --- vocabulary and size -------------------------------------------------------------------------------------
    vocab_size: int = ByteTokenizer.VOCAB_SIZE
    """Byte vocabulary: 256 bytes plus the tokenizer's special tokens."""
    d_model: int = 192
    """Residual stream width C."""
    n_layers: int = 12
    """Number of blocks (each = token mixer + MoE, each sub-layer wrapped by an mHC site)."""
    layer_pattern: str = "LLLS"
    """Repeated over the depth: L = KDA linear attention, S = DSA sparse attention."""
    max_seq_len: int = 192
    """Longest sequence the model accepts (training context)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""

    # --- attention heads (shared by KDA and DSA) -----------------------------------------------------------------
    n_heads: int = 6
    """Attention heads in both KDA and DSA layers."""
    head_dim: int = 32
    """Per-head dimension (KDA uses it for keys and values)."""

    # --- KDA (Kimi Delta Attention) ------------------------------------------------------------------------------
    kda_chunk_size: int = 32
    """Chunk length of the chunked (WY) training form; <= 32 keeps the fp32 factorised exp exact."""
    kda_conv_size: int = 4
    """Kernel of the causal depthwise short convolution on q/k/v."""
    kda_gate_lower_bound: float = -5.0
    """Safe gate: log-decay g = lb * sigmoid(...) lies in (lb, 0)."""

    # --- DSA (DeepSeek sparse attention with lightning indexer) --------------------------------------------------
    n_kv_heads: int = 6
    """Key/value heads of the main attention (GQA/MQA when < n_heads)."""
    attn_rope: bool = False
    """Apply RoPE in the main attention (default NoPE, as GLM-5.3 / Kimi Linear)."""
    index_n_heads: int = 4
    """Lightning-indexer heads H_I."""
    index_head_dim: int = 32
    """Lightning-indexer head dimension D_I."""
    index_rope_dim: int = 16
    """Leading indexer dims that get RoPE (the rest are position-free)."""
    index_top_k: int = 64
    """Keys kept per query; sequences with T <= index_top_k take the exact dense path."""
    indexer_loss_weight: float = 1.0
    """Weight of the indexer KL loss (to the detached main attention) inside aux_loss."""
    dsa_indexer: bool = True
    """False: no lightning indexer; the "S" layers attend to every causal key (dense softmax attention: the
    ablation of DSA's top-k selection, configs/experiments/ablation_*.yaml)."""
    rope_base: float = 10000.0
    """RoPE frequency base."""

    # --- MoE -----------------------------------------------------------------------------------------------------
    n_experts: int = 8
    """Routed SwiGLU experts E."""
    moe_top_k: int = 2
    """Experts chosen per token."""
    expert_hidden: int = 384
    """Hidden width of each routed expert."""
    shared_expert_hidden: int = 384
    """Hidden width of the always-on shared expert (0 disables it)."""
    routed_scaling: float = 1.0
    """Multiplier on the normalised routed gate weights."""
    balance_bias_rate: float = 1e-3
    """gamma of aux-loss-free balancing: bias step per optimizer step."""
    balance_loss_weight: float = 1e-4
    """alpha of the sequence-level balance loss (0 disables it)."""
    ffn: str = "moe"
    """The feed-forward sub-layer: "moe" (routed experts + shared expert) or "dense": one SwiGLU MLP of equal
    ACTIVE parameters per token, hidden = shared_expert_hidden + moe_top_k * expert_hidden (the MoE ablation)."""

    # --- mHC (manifold-constrained hyper-connections) ------------------------------------------------------------
    hc_streams: int = 4
    """Residual streams n; 1 reduces to a plain pre-norm residual."""
    sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations projecting H_res onto doubly stochastic matrices."""
    hc_eps: float = 1e-6
    """Epsilon in Sinkhorn denominators and added to H_pre."""
    hc_alpha_init: float = 0.01
    """Initial gating factor alpha of the dynamic (token-dependent) mHC mappings."""

    # --- presets -------------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GLMConfig:
        """A named preset (`tiny`, `demo`, `flash-25m`) with field overrides applied, validated."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown GLMConfig field(s) {sorted(unknown)}")
        cfg = replace(PRESETS[name], **overrides)
        cfg.validate()
        return cfg

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError on inconsistent settings."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"GLMConfig: {msg}")

        need(self.vocab_size >= ByteTokenizer.VOCAB_SIZE,
             f"vocab_size {self.vocab_size} < tokenizer vocabulary {ByteTokenizer.VOCAB_SIZE}")
        for name in ("d_model", "n_layers", "n_heads", "head_dim", "n_kv_heads", "max_seq_len", "n_experts",
                     "moe_top_k", "expert_hidden", "hc_streams", "kda_chunk_size", "kda_conv_size",
                     "index_n_heads", "index_head_dim", "index_top_k", "sinkhorn_iters"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.shared_expert_hidden >= 0, "shared_expert_hidden must be >= 0")
        need(self.d_model % self.n_heads == 0,
             f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        need(self.head_dim % 2 == 0, "head_dim must be even (RoPE rotates pairs)")
        need(self.moe_top_k <= self.n_experts,
             f"moe_top_k {self.moe_top_k} > n_experts {self.n_experts}")
        need(len(self.layer_pattern) > 0, "layer_pattern is empty")
        need(self.ffn in FFN_KINDS, f"ffn must be one of {FFN_KINDS}, got {self.ffn!r}")
        bad = sorted(set(self.layer_pattern) - set(LAYER_KINDS))
        need(not bad, f"unknown layer-pattern letter(s) {bad}; use {LAYER_KINDS}")
        need(0 <= self.index_rope_dim <= self.index_head_dim and self.index_rope_dim % 2 == 0,
             "index_rope_dim must be even and <= index_head_dim")
        need(self.kda_gate_lower_bound < 0, "kda_gate_lower_bound must be negative")
        need(self.kda_chunk_size * -self.kda_gate_lower_bound / 2 < 85,
             "kda_chunk_size * |kda_gate_lower_bound| / 2 must stay < 85 (fp32 exp overflow in the chunked form)")

    @property
    def layer_kinds(self) -> list[str]:
        """The letter ('L' or 'S') of every layer, the pattern repeated over the depth."""
        reps = -(-self.n_layers // len(self.layer_pattern))
        return list((self.layer_pattern * reps)[: self.n_layers])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _presets() -> dict[str, GLMConfig]:
    tiny = GLMConfig(
        d_model=32, n_layers=4, layer_pattern="LLLS", max_seq_len=64, n_heads=2, head_dim=16, n_kv_heads=2,
        kda_chunk_size=16, index_n_heads=2, index_head_dim=16, index_rope_dim=8, index_top_k=8,
        n_experts=4, moe_top_k=2, expert_hidden=32, shared_expert_hidden=32, hc_streams=2,
    )
    # the `make demo` model: every demo stage and the RL studies share it, so their checkpoints load into each other
    demo = replace(tiny, d_model=96, n_heads=3, head_dim=32, n_kv_heads=3, max_seq_len=192, index_head_dim=32,
                   index_rope_dim=16, index_top_k=64, expert_hidden=192, shared_expert_hidden=192)
    flash = GLMConfig()  # the defaults are the flash-25m preset
    return {"tiny": tiny, "demo": demo, "flash-25m": flash}


PRESETS: dict[str, GLMConfig] = _presets()
