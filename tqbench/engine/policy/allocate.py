"""Per-layer bit allocation from measured sensitivity.

Given, for every layer, the KL a 2-bit TurboQuant K (and V) of that layer alone costs, pick bits per
(layer, role) in 1..4 that minimise the predicted total KL under a bits-per-element budget. The model:
KL(layer, role, b) = s(layer, role) * f(b), with f TurboQuant's unit-vector MSE at b bits over its MSE at
2 bits (``MSE_RATIO``, the default; ``model="kl"`` uses per-bit KL ratios of uniform policies instead). Every step costs the
same (one bit on one layer-role) and f is convex, so greedy by marginal gain is optimal for this model.
"""

from __future__ import annotations

from collections import defaultdict

from tqbench.engine.policy.spec import Policy, parse_policy

#: TurboQuant MSE on unit vectors relative to 2 bits (d=64, measured: 0.359 / 0.114 / 0.0334 / 0.0091)
MSE_RATIO = {1: 0.359 / 0.114, 2: 1.0, 3: 0.0334 / 0.114, 4: 0.0091 / 0.114}
#: KL falls faster than MSE: uniform turbo K/V on SmolLM2 (teacher-forced, benchmarks/quality.py) gave
#: K2V2 0.084, K3V3 0.0148, K4V4 0.0033 (x5.7 and x4.5 per bit) and K4V1 / K4V2 0.28 / 0.028 (x10 for the
#: last bit). ``model="kl"`` uses these; measured on held-out text it allocated worse than the MSE ratios
#: (3.5 bits: KL 0.0106 vs 0.0096; 2.5 bits: 0.072 vs 0.058), so "mse" is the default.
KL_RATIO = {1: 10.0, 2: 1.0, 3: 1 / 5.7, 4: 1 / (5.7 * 4.5)}
NORM_BITS = 16  # one fp16 norm per row


def row_bits(bits: int, head_dim: int) -> float:
    return bits + NORM_BITS / head_dim


def allocate_bits(
    sens_k: list[float], sens_v: list[float], budget: float, head_dim: int, fp_overhead: float = 0.0,
    min_bits: int = 1, max_bits: int = 4, model: str = "mse",
) -> tuple[list[int], list[int], float]:
    """Bits for K and V per layer whose mean packed bits/element + ``fp_overhead`` stays within ``budget``.

    Returns (k_bits, v_bits, predicted_kl). ``fp_overhead``: bits/element the fp16 sink/window rows add.
    """
    if model not in ("kl", "mse"):
        raise ValueError(f"model={model!r} is invalid: use 'kl' (measured KL ratios) or 'mse'")
    ratio = KL_RATIO if model == "kl" else MSE_RATIO
    n = len(sens_k)
    if len(sens_v) != n or n == 0:
        raise ValueError("sens_k and sens_v need one value per layer")
    bits = {("k", i): min_bits for i in range(n)} | {("v", i): min_bits for i in range(n)}
    sens = {("k", i): sens_k[i] for i in range(n)} | {("v", i): sens_v[i] for i in range(n)}

    def mean_bits() -> float:
        return sum(row_bits(b, head_dim) for b in bits.values()) / (2 * n) + fp_overhead

    if mean_bits() > budget:
        raise ValueError(f"budget {budget} bits/element is below the minimum of {mean_bits():.3f}")
    while True:
        best, gain = None, 0.0
        for key, b in bits.items():
            if b < max_bits:
                g = sens[key] * (ratio[b] - ratio[b + 1])
                if g > gain:
                    best, gain = key, g
        if best is None:
            break
        bits[best] += 1
        if mean_bits() > budget + 1e-12:
            bits[best] -= 1
            break
    predicted = sum(sens[key] * ratio[b] for key, b in bits.items())
    return [bits[("k", i)] for i in range(n)], [bits[("v", i)] for i in range(n)], predicted


def allocation_policy(k_bits: list[int], v_bits: list[int], sink: int, recent: int, name: str | None = None) -> Policy:
    """A policy with per-layer overrides: the most common width is the default, the rest are overrides."""
    heads, overrides = [], []
    for role, per_layer in (("k", k_bits), ("v", v_bits)):
        common = max(set(per_layer), key=per_layer.count)
        heads.append(f"{role}=turbo{common}")
        groups: dict[int, list[int]] = defaultdict(list)
        for layer, b in enumerate(per_layer):
            if b != common:
                groups[b].append(layer)
        overrides += [f"{role}@{'+'.join(map(str, layers))}=turbo{b}" for b, layers in sorted(groups.items())]
    pol = parse_policy(",".join([*heads, f"sink={sink}", f"recent={recent}", *overrides]))
    return pol.with_name(name) if name else pol
