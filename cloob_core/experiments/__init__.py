"""Grids of training runs: the paper's objective ablation and the recipe sweep behind the defaults."""
