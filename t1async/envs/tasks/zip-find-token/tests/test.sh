#!/bin/bash
cd /app
python3 -m pytest -rA -q /tests/test_outputs.py
