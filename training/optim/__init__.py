"""Optimisers: AdamW/Muon with parameter groups and schedules, K-FAC, and the matrix preconditioners."""
