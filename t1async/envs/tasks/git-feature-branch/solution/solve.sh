#!/bin/bash
cd /app/repo
git checkout -q -b feature/greeting main
echo 'Hello, team!' > greeting.txt
git add greeting.txt
git commit -q -m "Add greeting"
git checkout -q main
