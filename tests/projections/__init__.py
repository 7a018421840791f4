"""Tests of the store and the view (projections/)."""
