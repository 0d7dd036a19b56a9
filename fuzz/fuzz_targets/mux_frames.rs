#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| culvert::fuzzing::mux_frames(data));
