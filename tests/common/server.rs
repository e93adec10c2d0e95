//! The in-process test server: `lockstep serve`'s flags parsed as the CLI parses them, the
//! engine started (it returns once warm), and the app as a `Router` for `oneshot` calls or
//! served on a free port.

use lockstep::serve::{app_state, start_engine, ServeArgs};
use lockstep::server::app;

/// `lockstep serve` flags (after the subcommand), parsed by clap.
pub fn serve_args(flags: &[&str]) -> ServeArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let mut argv = vec!["lockstep"];
    argv.extend_from_slice(flags);
    Cli::parse_from(argv).serve
}

/// The app over a started engine (no socket: drive it with `tower::ServiceExt::oneshot`).
pub fn router(args: &ServeArgs) -> axum::Router {
    let (engine, limits) = start_engine(args).expect("the engine starts");
    app(app_state(args, engine, limits))
}

/// The app served on a free port by a runtime of its own; returns its base URL.
pub fn spawn_server(args: ServeArgs) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(async move {
            let r = router(&args);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(format!("http://{}", listener.local_addr().unwrap()))
                .unwrap();
            axum::serve(listener, r).await.unwrap();
        });
    });
    rx.recv().expect("the server starts")
}
