#!/bin/bash
cd /app
mkdir -p configs
unzip -q -o configs.zip -d configs
f=$(cd configs && grep -rl '^API_TOKEN=' .)
echo "${f#./}" > token_file.txt
grep -h '^API_TOKEN=' "configs/${f#./}" | cut -d= -f2- > token.txt
