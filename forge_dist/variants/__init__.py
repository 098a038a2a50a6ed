"""The math of every variant: affine transitions, PyTorch chunk forms, fp64 references."""
from . import reference, transitions
from .base import SegmentSummary, VariantSpec
from .transitions import Kind

__all__ = ["Kind", "SegmentSummary", "VariantSpec", "reference", "transitions"]
