set -e
git init -q -b main repo
cd repo
git config user.name Dev
git config user.email dev@example.com
printf '# Greeter\n' > README.md
git add README.md
GIT_AUTHOR_DATE='2024-01-01T10:00:00Z' GIT_COMMITTER_DATE='2024-01-01T10:00:00Z' git commit -q -m "Add README"
printf 'print("hi")\n' > app.py
git add app.py
GIT_AUTHOR_DATE='2024-01-02T10:00:00Z' GIT_COMMITTER_DATE='2024-01-02T10:00:00Z' git commit -q -m "Add app"
git rev-parse HEAD > /app/.main_tip
