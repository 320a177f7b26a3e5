"""Test-only shims that let GPU-only libraries run on this CPU machine. Never imported by the
product (a test checks that nothing under planner/, simulator/, executor/, profiles/ or
reports/ imports ``tests``)."""
