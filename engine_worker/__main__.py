from engine_worker.cli import main

if __name__ == "__main__":
    main()
