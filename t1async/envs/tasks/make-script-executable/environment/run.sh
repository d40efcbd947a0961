#!/bin/bash
echo "service ready"
