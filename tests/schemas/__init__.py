"""Tests of the wire format (schemas/)."""
