"""Base models: the family table, names, the model zoo (loading), Hub ids and fingerprints."""
