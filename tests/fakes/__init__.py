"""Fakes of slicebox's OS interfaces, for unit tests (they prove logic, never features)."""
