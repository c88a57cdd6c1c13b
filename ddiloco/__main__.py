from ddiloco.cli import app

app()
