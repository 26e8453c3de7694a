"""The stage declarations, one module per stage (with the helper steps only it uses); `flows/registry.py` lists
them. Each module exports `StageDef`s; heavy libraries are imported inside the run functions, so the CLI can read
every declaration without loading torch."""
