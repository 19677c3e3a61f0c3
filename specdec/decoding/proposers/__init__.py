"""Proposers: where draft tokens come from. One per file, all with the shape of `base.Proposer`."""

from specdec.decoding.proposers.base import Proposal, Proposer
from specdec.decoding.proposers.model import DraftModelProposer
from specdec.decoding.proposers.hybrid import HybridProposer
from specdec.decoding.proposers.ngram import NgramProposer, find_continuation

#: Draft specs that are not models.
NON_MODEL_DRAFTS = ("ngram", "none")

__all__ = ["Proposal", "Proposer", "DraftModelProposer", "HybridProposer", "NgramProposer", "find_continuation", "NON_MODEL_DRAFTS"]
