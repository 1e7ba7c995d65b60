"""The controller's runtime (rank 0 of a cell job, or the main thread of a one-cell run): the orchestrator
(`orchestrator.Controller`), its view of the cells, the step book, training and switching, sessions."""
