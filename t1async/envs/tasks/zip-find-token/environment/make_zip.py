import zipfile

files = {
    "README.txt": "Service configuration bundle.\n# API_TOKEN must never be committed in plain text\n",
    "services/web.env": "PORT=8000\nWORKERS=3\n",
    "services/billing/billing.env": "PORT=8100\nCURRENCY=EUR\nAPI_TOKEN=tk_5f2a9c71e0\nTIMEOUT=30\n",
    "services/billing/notes.md": "Rotate the token every 90 days.\n",
    "shared/defaults.env": "LOG_LEVEL=info\nAPI_URL=https://api.internal\n",
}
with zipfile.ZipFile("configs.zip", "w", zipfile.ZIP_DEFLATED) as z:
    for name, text in files.items():
        z.writestr(zipfile.ZipInfo(name, (2024, 1, 1, 0, 0, 0)), text)
