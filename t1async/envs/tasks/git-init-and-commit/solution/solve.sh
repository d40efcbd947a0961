#!/bin/bash
cd /app/site
git init -q
git config user.name Dev
git config user.email dev@example.com
git add index.html style.css
git commit -q -m "Initial commit"
