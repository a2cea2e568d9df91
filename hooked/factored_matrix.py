"""FactoredMatrix: a product A @ B kept as its two factors (TransformerLens's semantics).

Glossary
    A, B      the factors, [..., ldim, mdim] and [..., mdim, rdim]; leading axes broadcast
    ldim      rows of the product (e.g. d_model for QK and OV circuits)
    mdim      the inner (low) rank: d_head for a head's circuits
    rdim      columns of the product
    AB        the full product [..., ldim, rdim]; BA the [..., mdim, mdim] product (ldim == rdim)
    svd()     (U, S, V) with AB = U @ diag(S) @ V^T, computed from the factors in O(mdim^2) memory
              beyond them; V holds the right singular vectors as columns (TL names it V; TL's Vh
              alias returns V too, and is kept for its users)

A head's circuits: `QK = FactoredMatrix(W_Q, W_K^T)` ([d_model d_model], the bilinear form of the
scores before scaling) and `OV = FactoredMatrix(W_V, W_O)` (what a head writes per token it reads).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Complex, Float
from torch import Tensor


class FactoredMatrix:
    def __init__(self, A: Float[Tensor, "*la ldim mdim"], B: Float[Tensor, "*lb mdim rdim"]) -> None:
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(f"factors must agree on the inner dimension: A {tuple(A.shape)}, B {tuple(B.shape)}")
        lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.A = A.broadcast_to((*lead, self.ldim, self.mdim))
        self.B = B.broadcast_to((*lead, self.mdim, self.rdim))
        self.shape = torch.Size((*lead, self.ldim, self.rdim))
        self._svd: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={tuple(self.shape)}, inner rank {self.mdim})"

    # --------------------------------------------------------------------------- products
    @property
    def AB(self) -> Float[Tensor, "*lead ldim rdim"]:
        return self.A @ self.B

    @property
    def BA(self) -> Float[Tensor, "*lead mdim mdim"]:
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square product, got {tuple(self.shape)}")
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def __matmul__(self, other: Any) -> Any:
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        if other.ndim < 2:  # a vector: collapse to a vector
            return (self.A @ (self.B @ other[..., None]))[..., 0]
        if other.shape[-2] != self.rdim:
            raise ValueError(f"cannot multiply {tuple(self.shape)} by {tuple(other.shape)}")
        return FactoredMatrix(self.A, self.B @ other) if self.rdim > self.mdim else FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other: Any) -> Any:
        if other.shape[-1] != self.ldim:
            raise ValueError(f"cannot multiply {tuple(other.shape)} by {tuple(self.shape)}")
        if other.ndim < 2:
            return ((other[..., None, :] @ self.A) @ self.B)[..., 0, :]
        return FactoredMatrix(other @ self.A, self.B) if self.ldim > self.mdim else FactoredMatrix(other, self.AB)

    def __mul__(self, scalar: float | Tensor) -> "FactoredMatrix":
        if isinstance(scalar, Tensor) and scalar.numel() != 1:
            raise ValueError(f"* takes a scalar, got shape {tuple(scalar.shape)}; use @ for products")
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    # ------------------------------------------------------------------------ decompositions
    def svd(self) -> tuple[Float[Tensor, "*lead ldim mdim"], Float[Tensor, "*lead mdim"], Float[Tensor, "*lead rdim mdim"]]:
        """(U, S, V), AB = U diag(S) V^T, from the SVDs of the factors and of their small middle."""
        if self._svd is None:
            Ua, Sa, Vha = torch.linalg.svd(self.A, full_matrices=False)
            Ub, Sb, Vhb = torch.linalg.svd(self.B, full_matrices=False)
            middle = Sa[..., :, None] * (Vha @ Ub) * Sb[..., None, :]
            Um, Sm, Vhm = torch.linalg.svd(middle, full_matrices=False)
            self._svd = (Ua @ Um, Sm, Vhb.transpose(-2, -1) @ Vhm.transpose(-2, -1))
        return self._svd

    @property
    def U(self) -> Tensor:
        return self.svd()[0]

    @property
    def S(self) -> Tensor:
        return self.svd()[1]

    @property
    def V(self) -> Tensor:
        return self.svd()[2]

    Vh = V  # TL's name for the same tensor (right singular vectors as columns)

    @property
    def eigenvalues(self) -> Complex[Tensor, "*lead mdim"]:
        """Eigenvalues of BA: the non-zero eigenvalues of AB."""
        ba = self.BA
        return torch.linalg.eigvals(ba.float() if ba.dtype in (torch.float16, torch.bfloat16) else ba)

    def norm(self) -> Float[Tensor, "*lead"]:
        """Frobenius norm of AB (the root of the sum of squared singular values)."""
        return self.S.pow(2).sum(-1).sqrt()

    def get_corner(self, k: int = 3) -> Tensor:
        return self[..., :k, :k].AB

    def collapse_l(self) -> Tensor:
        """S V^T: the product with its left orthonormal factor removed, [..., mdim, rdim]."""
        return self.S[..., :, None] * self.V.transpose(-2, -1)

    def collapse_r(self) -> Tensor:
        """U S: the product with its right orthonormal factor removed, [..., ldim, mdim]."""
        return self.U * self.S[..., None, :]

    def unsqueeze(self, k: int) -> "FactoredMatrix":
        return FactoredMatrix(self.A.unsqueeze(k), self.B.unsqueeze(k))

    # ------------------------------------------------------------------------------ indexing
    def __getitem__(self, idx: Any) -> "FactoredMatrix":
        """Index leading axes; the last two index rows of A and columns of B (kept 2-D)."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(i is Ellipsis for i in idx):
            before = idx[: idx.index(Ellipsis)]
            after = idx[idx.index(Ellipsis) + 1:]
            idx = before + (slice(None),) * (self.ndim - len(before) - len(after)) + after
        n_lead = self.ndim - 2
        lead, rows, cols = idx[:n_lead], idx[n_lead:n_lead + 1], idx[n_lead + 1:n_lead + 2]
        as_slice = lambda i: slice(i, i + 1 if i != -1 else None) if isinstance(i, int) else i  # noqa: E731
        A = self.A[lead + (as_slice(rows[0]) if rows else slice(None),)]
        B = self.B[lead + (slice(None), as_slice(cols[0]) if cols else slice(None))]
        return FactoredMatrix(A, B)
