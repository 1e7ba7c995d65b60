"""A cell's runtime: its leader (`worker.CellWorker`), engine, other ranks, and its part of the gradient
reduction."""
