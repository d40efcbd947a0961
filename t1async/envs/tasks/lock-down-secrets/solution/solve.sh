#!/bin/bash
cd /app
find secrets -type d -exec chmod 700 {} +
find secrets -type f -exec chmod 600 {} +
chmod 755 public
chmod 644 public/*
