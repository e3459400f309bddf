"""The contrastive objectives: the math of the papers, restricted negatives, poly-view, distribution."""
