from engine.cli import main

main()
