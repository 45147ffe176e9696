"""Hand-made graphs for tests that must not depend on the zoo."""

from __future__ import annotations

from mosaic.graph import MMGraph, ModuleSpec


def spec(name: str, kind: str = "encoder", params_m: float = 50.0, tokens: int = 256,
         dim: int = 768, layers: int = 12) -> ModuleSpec:
    params = int(params_m * 1e6)
    return ModuleSpec(
        name=name, kind=kind, input_shape=(tokens, dim), num_params=params, num_layers=layers,
        hidden_dim=dim, tokens_per_sample=tokens, flops_per_sample=6.0 * params * tokens,
        activation_bytes_per_sample=34.0 * tokens * dim * layers,
        output_bytes_per_sample=2.0 * tokens * dim,
    )


def encoders_and_head(num_encoders: int = 3, batch: int = 32, head_kind: str = "head") -> MMGraph:
    encoders = [spec(f"enc{i}", params_m=20.0 * (i + 1), layers=4 * (i + 1)) for i in range(num_encoders)]
    head = spec("head", kind=head_kind, params_m=5.0, tokens=1, layers=1)
    return MMGraph(name="toy", modules=(*encoders, head),
                   edges=tuple((e.name, "head") for e in encoders), global_batch=batch)
