set -e
git init -q -b main project
cd project
git config user.name Dev
git config user.email dev@example.com
day=1
commit() {
  GIT_AUTHOR_DATE="2024-02-0${day}T09:00:00Z" GIT_COMMITTER_DATE="2024-02-0${day}T09:00:00Z" git commit -q -am "$1"
  day=$((day + 1))
}
printf 'HOST = "localhost"\nPORT = 5000\n' > settings.py
printf 'from settings import HOST, PORT\n' > server.py
git add settings.py server.py
commit "Initial settings"
printf 'HOST = "localhost"\nPORT = 5000\nTIMEOUT = 10\n' > settings.py
commit "Add timeout"
printf 'HOST = "0.0.0.0"\nPORT = 5000\nTIMEOUT = 10\nRETRIES = 7\n' > settings.py
commit "Tune network settings"
printf 'from settings import HOST, PORT, TIMEOUT\n' > server.py
commit "Use timeout in server"
printf 'HOST = "0.0.0.0"\nPORT = 8000\nTIMEOUT = 10\nRETRIES = 7\n' > settings.py
commit "Change port"
printf 'HOST = "0.0.0.0"\nPORT = 8000\nTIMEOUT = 30\nRETRIES = 3\n' > settings.py
commit "Production values"
