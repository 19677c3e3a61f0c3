"""Proposers: where draft tokens come from. One per file, all with the shape of `base.Proposer`."""

from specdec.proposers.base import Proposal, Proposer
from specdec.proposers.model import DraftModelProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer, find_continuation

#: Draft specs that are not models.
NON_MODEL_DRAFTS = ("ngram", "none")

__all__ = ["Proposal", "Proposer", "DraftModelProposer", "HybridProposer", "NgramProposer", "find_continuation", "NON_MODEL_DRAFTS"]
