"""Test helpers that ship with the package so CPU tests, GPU tests and scripts share them:
`fuzz` (random-problem fuzzing of every solver through the public API)."""
