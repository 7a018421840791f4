"""Tests of the per-parent reports (processors/audit/)."""
