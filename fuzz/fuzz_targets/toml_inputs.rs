#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    glmcheck::fuzzing::toml_inputs(data);
});
