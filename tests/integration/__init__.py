"""Integration tests: real kvgrid processes on loopback. A package, so that its conftest module
does not clash with another test directory's when pytest collects both in one session."""
