#!/bin/bash
mkdir -p /app/extracted
tar -xzf /app/bundle.tar.gz -C /app/extracted
