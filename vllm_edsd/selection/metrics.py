"""EDSelect (docs/architecture.md, "Data flow"): score every target layer's representations and pick two.

Layer ids are vLLM's: id l is the residual stream at the input of decoder layer l (1..N;
id 0, the raw embeddings, carries no context and is not a candidate). Metrics, all computed
in float64 on the non-padding tokens of a calibration set:

* matrix entropy (order α→1): rows of Z (tokens × D) are centred and L2-normalised
  (Skean et al. 2025); with λ the eigenvalues of ZᵀZ and p = λ/Σλ, M₁ = −Σ p log p.
* Curvature (Hosseini & Fedorenko 2023): per sequence, v_t = z_{t+1} − z_t and
  θ_t = arccos(cos(v_t, v_{t+1})); curvature c = mean θ over t and sequences. Reported as
  **π − c** so that higher is better (straighter trajectories), as the paper plots it.
* LiDAR (Thilak et al. 2024): one class per calibration sequence, made of the sequence and
  ``copies`` perturbed versions of it (each non-first token replaced by a random token with
  probability ``rate``), each pooled to its mean token representation. Σ_b = covariance of the
  class means, Σ_w = mean within-class covariance, Σ_lda = (Σ_w + δI)^(-1/2) Σ_b (Σ_w + δI)^(-1/2)
  with δ = 1e-4 · tr(Σ_w)/D + 1e-8; LiDAR = exp(−Σ p log p), p = λ(Σ_lda)/Σλ (effective rank).

Which score picks which layer (the paper's appendix A.1): EDSelect replaces EAGLE-3's middle and
high layers by the layers that maximise Curvature and LiDAR respectively. So LiDAR picks the
**high** layer, its maximum over the top quarter of the decoder-layer inputs (ids ⌈3N/4⌉..N−1),
and Curvature the **middle** one, its maximum over ids 2..⌈3N/4⌉−1 (the layer next to the
embeddings, id 1, is left out: the paper's Table 6 shows that a low layer hurts EDSD). Every pick
of the paper's Table 15 lies in these ranges (``PAPER_PICKS``); the ranges keep this estimator's
LiDAR, whose maximum on small targets is id 1 (docs/paper.md, "EDSelect"), from choosing a layer
the paper never chose. Targets with fewer than 4 layers have no such ranges: there the two
maxima over all ids are taken (if they coincide, the second layer is the next best by LiDAR).
"""

from __future__ import annotations

import math

import torch

PERTURB_RATE = 0.1
PERTURB_COPIES = 4


def _spectral_entropy(eigenvalues: torch.Tensor) -> float:
    lam = eigenvalues.clamp(min=0)
    p = lam / lam.sum()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def matrix_entropy(z: torch.Tensor) -> float:
    """M₁ of the (tokens × D) matrix ``z`` (rows centred and normalised)."""
    z = z.double()
    z = z - z.mean(0, keepdim=True)
    z = z / z.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return _spectral_entropy(torch.linalg.eigvalsh(z.T @ z))


class Curvature:
    """Running mean angle between consecutive steps of token trajectories (one sequence at a time)."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def add(self, z: torch.Tensor) -> None:
        if len(z) < 3:
            return
        v = z.double().diff(dim=0)
        cos = torch.nn.functional.cosine_similarity(v[:-1], v[1:], dim=-1).clamp(-1, 1)
        self.total += float(torch.arccos(cos).sum())
        self.count += len(cos)

    def score(self) -> float:
        """π minus the mean angle (higher: straighter trajectories)."""
        if not self.count:
            raise ValueError("curvature needs sequences of at least 3 tokens")
        return math.pi - self.total / self.count


def curvature_score(sequences: list[torch.Tensor]) -> float:
    """π minus the mean angle between consecutive steps of each token trajectory."""
    curvature = Curvature()
    for z in sequences:
        curvature.add(z)
    return curvature.score()


class ClassScatter:
    """Between- and within-class covariance for LiDAR, one class at a time: two D×D sums,
    whatever the number of classes."""

    def __init__(self, d: int) -> None:
        self.classes = 0
        self.mean_sum = torch.zeros(d, dtype=torch.float64)
        self.mean_outer = torch.zeros(d, d, dtype=torch.float64)
        self.within_sum = torch.zeros(d, d, dtype=torch.float64)

    def add(self, members: torch.Tensor) -> None:
        """One class: (copies × D) pooled representations."""
        members = members.double()
        mean = members.mean(0)
        centred = members - mean
        self.within_sum += centred.T @ centred / (len(members) - 1)
        self.mean_sum += mean
        self.mean_outer += torch.outer(mean, mean)
        self.classes += 1

    def lidar(self) -> float:
        """Effective rank of the LDA matrix."""
        n, d = self.classes, len(self.mean_sum)
        sigma_w = self.within_sum / n
        mu = self.mean_sum / n
        sigma_b = (
            (self.mean_outer - n * torch.outer(mu, mu)) / (n - 1) if n > 1 else torch.zeros(d, d, dtype=torch.float64)
        )
        delta = 1e-4 * float(torch.trace(sigma_w)) / d + 1e-8
        eigval, eigvec = torch.linalg.eigh(sigma_w + delta * torch.eye(d, dtype=torch.float64))
        inv_sqrt = eigvec @ torch.diag(eigval.clamp(min=1e-12).rsqrt()) @ eigvec.T
        return math.exp(_spectral_entropy(torch.linalg.eigvalsh(inv_sqrt @ sigma_b @ inv_sqrt)))


def lidar(classes: list[torch.Tensor]) -> float:
    """Effective rank of the LDA matrix; ``classes[i]`` is (copies × D) pooled representations."""
    scatter = ClassScatter(classes[0].shape[1])
    for members in classes:
        scatter.add(members)
    return scatter.lidar()


class LayerStatistics:
    """Everything EDSelect needs of one layer, fed one calibration sequence (with its perturbed
    copies) at a time: two D×D matrices and at most ``token_budget`` sampled token states, so
    memory does not grow with the number of sequences."""

    def __init__(self, d: int, token_budget: int) -> None:
        self.curvature, self.scatter = Curvature(), ClassScatter(d)
        self.tokens: list[torch.Tensor] = []
        self.token_budget = token_budget

    def add(self, variants: torch.Tensor, picks: torch.Tensor) -> None:
        """``variants`` [1 + copies, T, D]: the sequence first; ``picks``: its token indices kept
        for the matrix entropy."""
        self.curvature.add(variants[0])
        self.scatter.add(variants.double().mean(1))
        kept = sum(len(t) for t in self.tokens)
        self.tokens.append(variants[0, picks[: max(0, self.token_budget - kept)]].float())

    def scores(self) -> dict[str, float]:
        return {"curvature": self.curvature.score(), "lidar": self.scatter.lidar(),
                "matrix_entropy": matrix_entropy(torch.cat(self.tokens))}


def perturb(ids: torch.Tensor, vocab_size: int, generator: torch.Generator, rate: float = PERTURB_RATE) -> torch.Tensor:
    """A copy of ``ids`` with each token after the first replaced at random with probability ``rate``."""
    out = ids.clone()
    swap = torch.rand(ids.shape, generator=generator) < rate
    swap[..., 0] = False
    out[swap] = torch.randint(0, vocab_size, (int(swap.sum()),), generator=generator)
    return out


# Table 15 of the paper: decoder layers N, then the layers EDSelect chose (vLLM's convention),
# Curvature's (the middle layer) first.
PAPER_PICKS = {"Llama-3.1-8B": (32, 16, 29), "DeepSeek-R1-Distill-Llama-8B": (32, 16, 30), "Qwen3-8B": (36, 24, 35),
               "Llama-3.3-70B": (80, 14, 79), "Qwen3-30B-A3B": (48, 13, 45)}


def role_ranges(num_layers: int) -> dict[str, range] | None:
    """The ids each metric chooses from in a target of ``num_layers`` decoder layers: Curvature
    the middle layer, LiDAR the high one; None where the target is too shallow for both."""
    high = math.ceil(3 * num_layers / 4)
    ranges = {"curvature": range(2, high), "lidar": range(high, num_layers)}
    return ranges if all(ranges.values()) else None


def select_layers(scores: dict[int, dict[str, float]], num_layers: int) -> tuple[int, int, dict[str, int]]:
    """(layer a, layer b, which metric chose which), ids ascending."""
    ranges = role_ranges(num_layers)
    if ranges is None:
        by_lidar = sorted(scores, key=lambda l: (-scores[l]["lidar"], l))
        curvature_layer = max(sorted(scores), key=lambda l: scores[l]["curvature"])
        lidar_layer = next(l for l in by_lidar if l != curvature_layer)
    else:
        curvature_layer = max(ranges["curvature"], key=lambda l: scores[l]["curvature"])
        lidar_layer = max(ranges["lidar"], key=lambda l: scores[l]["lidar"])
    a, b = sorted((curvature_layer, lidar_layer))
    return a, b, {"curvature": curvature_layer, "lidar": lidar_layer}
