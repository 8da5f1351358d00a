//! Generates the prost types from `proto/*.proto` with `protox`, so no system `protoc` is needed.

fn main() {
    let files = ["proto/peer.proto", "proto/client.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"]).expect("proto files must compile");
    prost_build::Config::new()
        .bytes(["."])
        .compile_fds(fds)
        .expect("prost code generation must succeed");
}
