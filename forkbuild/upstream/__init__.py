"""Upstream: the test PRs for the newest release, the differential mutants, the
release's CI jobs that a change triggers, and the trial rebase onto another release.
"""
