"""Penalised logP, the target of the ZINC benchmark, computed with RDKit.

    plogp = logP - SA - max(largest ring size - 6, 0)

logP is Crippen's (RDKit's `MolLogP`), SA the synthetic accessibility score of Ertl and
Schuffenhauer (RDKit's Contrib `sascorer`). ZINC's own target ("logP_SA_cycle_normalized")
standardises each term with statistics of the 250k JT-VAE molecules before combining them;
`penalized_logp_normalized` gives that scale. The largest ring comes from RDKit's ring perception
(smallest set of smallest rings). The JT-VAE code that made ZINC's targets takes it from a
networkx cycle basis instead, which can report the envelope of fused rings: the two disagree on 7
of 2,000 random MOSES molecules.
"""

from __future__ import annotations

from rdkit import Chem
from rdkit.Chem import Crippen
from rdkit.Contrib.SA_Score import sascorer

# JT-VAE statistics over 250k ZINC molecules (mean, std) of logP, SA and the ring penalty.
LOGP_MEAN, LOGP_STD = 2.4570953396190123, 1.434324401111988
SA_MEAN, SA_STD = 3.0525811293166134, 0.8335207024513095
RING_MEAN, RING_STD = 0.0485696876403053, 0.2860212110245455


def ring_penalty(mol: Chem.Mol) -> int:
    """max(largest ring size - 6, 0), 0 without rings."""
    rings = mol.GetRingInfo().AtomRings()
    return max(max((len(ring) for ring in rings), default=0) - 6, 0)


def penalized_logp(mol: Chem.Mol) -> float:
    """logP - SA - ring penalty."""
    return Crippen.MolLogP(mol) - sascorer.calculateScore(mol) - ring_penalty(mol)


def penalized_logp_normalized(mol: Chem.Mol) -> float:
    """ZINC's scale: each term standardised with the JT-VAE statistics, then combined."""
    return (
        (Crippen.MolLogP(mol) - LOGP_MEAN) / LOGP_STD
        - (sascorer.calculateScore(mol) - SA_MEAN) / SA_STD
        - (ring_penalty(mol) - RING_MEAN) / RING_STD
    )


PLOGP_TARGETS = {"plogp": penalized_logp, "plogp-normalized": penalized_logp_normalized}
