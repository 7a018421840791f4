"""Tests of offline replay (processors/replay/)."""
