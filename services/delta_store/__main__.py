from services.delta_store.server import main

main()
