;; slicebox's test plugin, in WebAssembly text; built with wabt's wat2wasm (tests/wasm/build.py).
;; It uses Extism's host ABI ("extism:host/env"): the input is read and the output written
;; through the host's own memory, one byte at a time (no PDK needed).
;;   echo         the input, unchanged
;;   count_vowels the number of vowels (a e i o u, either case) in the input, in decimal
;;   spin         loops forever (a timeout stops it)
;;   grow         grows its memory 16 pages at a time until refused (max_pages stops it)
;;   http_get     GETs the URL given as input; the response body is the output
(module
  (import "extism:host/env" "input_length" (func $input_length (result i64)))
  (import "extism:host/env" "input_load_u8" (func $input_load_u8 (param i64) (result i32)))
  (import "extism:host/env" "alloc" (func $alloc (param i64) (result i64)))
  (import "extism:host/env" "length" (func $length (param i64) (result i64)))
  (import "extism:host/env" "store_u8" (func $store_u8 (param i64 i32)))
  (import "extism:host/env" "output_set" (func $output_set (param i64 i64)))
  (import "extism:host/env" "http_request" (func $http_request (param i64 i64) (result i64)))
  (memory (export "memory") 1)
  (data (i32.const 0) "{\"method\":\"GET\",\"url\":\"")  ;; 23 bytes
  (data (i32.const 32) "\"}")

  ;; Copy `len` bytes of our memory at `from` into host memory at `to`.
  (func $copy_out (param $from i32) (param $len i32) (param $to i64)
    (local $i i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
      (call $store_u8 (i64.add (local.get $to) (i64.extend_i32_u (local.get $i)))
                      (i32.load8_u (i32.add (local.get $from) (local.get $i))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next))))

  ;; Copy the whole input into host memory at `to`.
  (func $copy_input (param $to i64)
    (local $n i64) (local $i i64)
    (local.set $n (call $input_length))
    (block $done (loop $next
      (br_if $done (i64.ge_u (local.get $i) (local.get $n)))
      (call $store_u8 (i64.add (local.get $to) (local.get $i))
                      (call $input_load_u8 (local.get $i)))
      (local.set $i (i64.add (local.get $i) (i64.const 1)))
      (br $next))))

  (func (export "echo") (result i32)
    (local $n i64) (local $out i64)
    (local.set $n (call $input_length))
    (local.set $out (call $alloc (local.get $n)))
    (call $copy_input (local.get $out))
    (call $output_set (local.get $out) (local.get $n))
    (i32.const 0))

  (func (export "count_vowels") (result i32)
    (local $n i64) (local $i i64) (local $c i32) (local $count i32) (local $at i32)
    (local $out i64)
    (local.set $n (call $input_length))
    (block $done (loop $next
      (br_if $done (i64.ge_u (local.get $i) (local.get $n)))
      (local.set $c (i32.or (call $input_load_u8 (local.get $i)) (i32.const 32)))
      (if (i32.or (i32.or (i32.eq (local.get $c) (i32.const 97))
                          (i32.eq (local.get $c) (i32.const 101)))
                  (i32.or (i32.or (i32.eq (local.get $c) (i32.const 105))
                                  (i32.eq (local.get $c) (i32.const 111)))
                          (i32.eq (local.get $c) (i32.const 117))))
        (then (local.set $count (i32.add (local.get $count) (i32.const 1)))))
      (local.set $i (i64.add (local.get $i) (i64.const 1)))
      (br $next)))
    ;; its decimal digits, last first, ending at byte 100
    (local.set $at (i32.const 100))
    (loop $digit
      (local.set $at (i32.sub (local.get $at) (i32.const 1)))
      (i32.store8 (local.get $at)
                  (i32.add (i32.const 48) (i32.rem_u (local.get $count) (i32.const 10))))
      (local.set $count (i32.div_u (local.get $count) (i32.const 10)))
      (br_if $digit (i32.ne (local.get $count) (i32.const 0))))
    (local.set $out (call $alloc (i64.extend_i32_u (i32.sub (i32.const 100) (local.get $at)))))
    (call $copy_out (local.get $at) (i32.sub (i32.const 100) (local.get $at)) (local.get $out))
    (call $output_set (local.get $out)
                      (i64.extend_i32_u (i32.sub (i32.const 100) (local.get $at))))
    (i32.const 0))

  (func (export "spin") (result i32)
    (loop $forever (br $forever))
    (i32.const 0))

  (func (export "grow") (result i32)
    (loop $more
      (br_if $more (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
    (unreachable))

  (func (export "http_get") (result i32)
    (local $n i64) (local $req i64) (local $resp i64)
    (local.set $n (call $input_length))
    (local.set $req (call $alloc (i64.add (local.get $n) (i64.const 25))))
    (call $copy_out (i32.const 0) (i32.const 23) (local.get $req))
    (call $copy_input (i64.add (local.get $req) (i64.const 23)))
    (call $copy_out (i32.const 32) (i32.const 2)
                    (i64.add (local.get $req) (i64.add (local.get $n) (i64.const 23))))
    (local.set $resp (call $http_request (local.get $req) (i64.const 0)))
    (call $output_set (local.get $resp) (call $length (local.get $resp)))
    (i32.const 0))
)
