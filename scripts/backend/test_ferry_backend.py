"""Tests of the reference backend against the real server process on loopback.

Run: scripts/backend/run-tests.sh   (python3 stdlib only; openssl CLI for the TLS test)
"""

import gzip
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
BACKEND = os.path.join(HERE, "ferry-backend")


class Backend:
    """One backend process on 127.0.0.1 with --port 0; the port comes from --port-file."""

    def __init__(self, workdir, *flags, db_name="backend.db"):
        self.workdir = workdir
        self.db = os.path.join(workdir, db_name)
        self.port_file = os.path.join(workdir, "port")
        if os.path.exists(self.port_file):
            os.remove(self.port_file)
        self.process = subprocess.Popen(
            [sys.executable, BACKEND, "serve", "--db", self.db, "--port", "0",
             "--port-file", self.port_file, "--quiet", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.port_file):
            if self.process.poll() is not None:
                raise RuntimeError("backend exited: %s" % self.process.stderr.read().decode())
            if time.monotonic() > deadline:
                raise RuntimeError("backend did not write its port file")
            time.sleep(0.02)
        with open(self.port_file) as handle:
            self.port = int(handle.read())

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=10)
        self.process.stderr.close()

    def connection(self, tls_context=None):
        if tls_context is not None:
            return http.client.HTTPSConnection("127.0.0.1", self.port, context=tls_context,
                                               timeout=10)
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    def post(self, body, key=None, token=None, headers=None, path="/ingest", tls_context=None):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json"}
        if key is None and isinstance(body, dict):
            key = body.get("batch")
        if key:
            all_headers["Idempotency-Key"] = key
        if token:
            all_headers["Authorization"] = "Bearer " + token
        all_headers.update(headers or {})
        connection = self.connection(tls_context)
        try:
            connection.request("POST", path, body=raw, headers=all_headers)
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), json.loads(response.read() or b"null")
        finally:
            connection.close()

    def control(self, **change):
        connection = self.connection()
        connection.request("POST", "/_ferry/control", body=json.dumps(change).encode(),
                           headers={"Content-Type": "application/json"})
        assert connection.getresponse().status == 200
        connection.close()

    def stats(self):
        out = subprocess.run([sys.executable, BACKEND, "stats", "--db", self.db],
                             check=True, capture_output=True)
        return json.loads(out.stdout)

    def dump(self):
        out = subprocess.run([sys.executable, BACKEND, "dump", "--db", self.db],
                             check=True, capture_output=True)
        return [json.loads(line) for line in out.stdout.decode().splitlines()]


def frames_batch(batch, seqs, peripheral="C0:FF:EE:00:00:01", epoch="0", event_id=None):
    return {"gateway": "gw-test", "batch": batch, "events": [
        {"id": event_id or ("ev-" + batch), "type": "FRAMES", "peripheral": peripheral,
         "epoch": epoch, "frames": [
             {"seq": str(seq), "payload": "aGVsbG8=", "received_at": "2026-11-30T15:00:00.123Z"}
             for seq in seqs]}]}


class BackendTestCase(unittest.TestCase):
    flags = ()

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix="ferry-backend-test-")
        self.backend = Backend(self.workdir, *self.flags)

    def tearDown(self):
        self.backend.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class ContractTests(BackendTestCase):
    def test_accepts_batch_and_reports_it(self):
        status, headers, body = self.backend.post(frames_batch("b1", [1, 2, 3]))
        self.assertEqual(status, 200)
        self.assertEqual(body["frames_stored"], 3)
        self.assertEqual(headers.get("Accept-Encoding"), "gzip")
        stats = self.backend.stats()
        self.assertEqual((stats["batches"], stats["frames"], stats["distinct_natural_keys"]), (1, 3, 3))
        self.assertEqual(stats["requests"], 1)

    def test_same_key_same_body_replays_without_second_side_effect(self):
        first = self.backend.post(frames_batch("b1", [1, 2]))
        second = self.backend.post(frames_batch("b1", [1, 2]))
        self.assertEqual(first[0], 200)
        self.assertEqual(second[0], 200)
        self.assertEqual(first[2], second[2])
        self.assertEqual(second[1].get("Idempotent-Replayed"), "true")
        stats = self.backend.stats()
        self.assertEqual((stats["frames"], stats["duplicates_rejected"], stats["idempotent_replays"]),
                         (2, 0, 1))

    def test_same_key_different_body_is_422(self):
        self.assertEqual(self.backend.post(frames_batch("b1", [1, 2]))[0], 200)
        status, _, body = self.backend.post(frames_batch("b1", [1, 2, 3]))
        self.assertEqual(status, 422)
        self.assertEqual(body["error"], "idempotency_key_reused")
        self.assertEqual(self.backend.stats()["distinct_natural_keys"], 2)

    def test_frames_dedupe_by_natural_key_across_batches(self):
        self.backend.post(frames_batch("b1", [1, 2, 3]))
        status, _, body = self.backend.post(frames_batch("b2", [3, 4]))
        self.assertEqual(status, 200)
        self.assertEqual((body["frames_stored"], body["frames_duplicate"]), (1, 1))
        # Another epoch or peripheral is another stream: seq 3 there is new.
        self.backend.post(frames_batch("b3", [3], epoch="7"))
        self.backend.post(frames_batch("b4", [3], peripheral="C0:FF:EE:00:00:02"))
        stats = self.backend.stats()
        self.assertEqual((stats["distinct_natural_keys"], stats["duplicates_rejected"]), (6, 1))

    def test_event_under_two_batches_is_reported(self):
        self.backend.post(frames_batch("b1", [1], event_id="e1"))
        self.backend.post(frames_batch("b2", [1], event_id="e1"))
        self.assertEqual(self.backend.stats()["events_in_multiple_batches"], 1)

    def test_gap_and_regression_are_stored(self):
        body = {"gateway": "gw", "batch": "b1", "events": [
            {"id": "g", "type": "GAP", "peripheral": "P", "epoch": "18446744073709551615",
             "first_seq": "42", "last_seq": "57", "detected_at": "2026-11-30T15:00:00.123Z"},
            {"id": "r", "type": "REGRESSION", "peripheral": "P", "epoch": "1", "cursor": "900",
             "head": "12", "detected_at": "2026-11-30T15:00:00.123Z"}]}
        self.assertEqual(self.backend.post(body)[0], 200)
        stats = self.backend.stats()
        self.assertEqual((stats["gaps"], stats["regressions"]), (1, 1))
        kinds = sorted(row["type"] for row in self.backend.dump())
        self.assertEqual(kinds, ["GAP", "REGRESSION"])

    def test_64_bit_values_round_trip_exactly(self):
        top = "18446744073709551615"
        self.assertEqual(self.backend.post(frames_batch("b1", [top], epoch=top))[0], 200)
        self.assertEqual(self.backend.dump()[0]["seq"], top)
        self.assertEqual(self.backend.post(frames_batch("b2", ["18446744073709551616"]))[0], 400)

    def test_malformed_bodies_get_400_with_reason(self):
        cases = {
            "not json": b"{",
            "epoch as number": {"gateway": "g", "batch": "k", "events": [
                {"id": "e", "type": "GAP", "peripheral": "P", "epoch": 0, "first_seq": "1",
                 "last_seq": "2", "detected_at": "2026-11-30T15:00:00.123Z"}]},
            "leading zero": frames_batch("k", ["01"]),
            "bad base64": {"gateway": "g", "batch": "k", "events": [
                {"id": "e", "type": "FRAMES", "peripheral": "P", "epoch": "0", "frames": [
                    {"seq": "1", "payload": "@@@", "received_at": "2026-11-30T15:00:00.123Z"}]}]},
            "empty events": {"gateway": "g", "batch": "k", "events": []},
            "unknown type": {"gateway": "g", "batch": "k", "events": [
                {"id": "e", "type": "NOPE", "peripheral": "P", "epoch": "0"}]},
            "gap reversed": {"gateway": "g", "batch": "k", "events": [
                {"id": "e", "type": "GAP", "peripheral": "P", "epoch": "0", "first_seq": "9",
                 "last_seq": "2", "detected_at": "2026-11-30T15:00:00.123Z"}]},
            "bad time": {"gateway": "g", "batch": "k", "events": [
                {"id": "e", "type": "FRAMES", "peripheral": "P", "epoch": "0", "frames": [
                    {"seq": "1", "payload": "", "received_at": "yesterday"}]}]},
        }
        for name, body in cases.items():
            with self.subTest(name):
                status, _, reply = self.backend.post(body, key="k")
                self.assertEqual(status, 400)
                self.assertTrue(reply["reason"])
        self.assertEqual(self.backend.post(frames_batch("b1", [1]), key="other")[0], 400)
        self.assertEqual(self.backend.stats()["distinct_natural_keys"], 0)

    def test_missing_idempotency_key_is_400(self):
        raw = json.dumps(frames_batch("b1", [1])).encode()
        self.assertEqual(self.backend.post(raw, key="")[0], 400)

    def test_gzip_body_is_accepted_and_hashes_like_the_plain_body(self):
        raw = json.dumps(frames_batch("b1", [1, 2])).encode()
        status, _, _ = self.backend.post(gzip.compress(raw), key="b1",
                                         headers={"Content-Encoding": "gzip"})
        self.assertEqual(status, 200)
        # The idempotency hash covers the decoded body: the plain retry is a replay.
        status, headers, _ = self.backend.post(raw, key="b1")
        self.assertEqual((status, headers.get("Idempotent-Replayed")), (200, "true"))

    def test_durable_idempotency_survives_restart(self):
        self.backend.post(frames_batch("b1", [1, 2]))
        self.backend.stop()
        self.backend = Backend(self.workdir)
        status, headers, _ = self.backend.post(frames_batch("b1", [1, 2]))
        self.assertEqual((status, headers.get("Idempotent-Replayed")), (200, "true"))
        self.assertEqual(self.backend.post(frames_batch("b1", [9]))[0], 422)


class ConcurrencyAndLimitTests(BackendTestCase):
    flags = ("--max-body-bytes", "4096")

    def test_concurrent_overlapping_batches_store_each_frame_once(self):
        import threading
        errors = []

        def worker(lane):
            try:
                for index in range(10):
                    # Every lane sends the same frames under its own batch ids.
                    status = self.backend.post(frames_batch("l%d-b%d" % (lane, index),
                                                            [index * 3 + 1, index * 3 + 2]))[0]
                    if status != 200:
                        errors.append(status)
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(lane,)) for lane in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(errors, [])
        stats = self.backend.stats()
        self.assertEqual((stats["distinct_natural_keys"], stats["duplicates_rejected"]), (20, 60))
        self.assertEqual(stats["batches"], 40)

    def test_oversized_and_gzip_bomb_bodies_are_refused(self):
        big = json.dumps(frames_batch("b1", range(1, 200))).encode()
        self.assertGreater(len(big), 4096)
        self.assertEqual(self.backend.post(big, key="b1")[0], 413)
        bomb = gzip.compress(b" " * 100000)
        status, _, body = self.backend.post(bomb, key="b2", headers={"Content-Encoding": "gzip"})
        self.assertEqual(status, 400)
        self.assertIn("exceeds", body["reason"])

    def test_keep_alive_serves_many_requests_on_one_connection(self):
        connection = self.backend.connection()
        try:
            for index in range(5):
                raw = json.dumps(frames_batch("k%d" % index, [index + 1])).encode()
                connection.request("POST", "/ingest", body=raw, headers={
                    "Content-Type": "application/json", "Idempotency-Key": "k%d" % index})
                response = connection.getresponse()
                response.read()
                self.assertEqual(response.status, 200)
        finally:
            connection.close()
        self.assertEqual(self.backend.stats()["connections_accepted"], 1)


class NoGzipTests(BackendTestCase):
    flags = ("--no-gzip",)

    def test_gzip_refused_with_415(self):
        raw = json.dumps(frames_batch("b1", [1])).encode()
        status, headers, _ = self.backend.post(gzip.compress(raw), key="b1",
                                               headers={"Content-Encoding": "gzip"})
        self.assertEqual(status, 415)
        self.assertNotIn("gzip", headers.get("Accept-Encoding", ""))


class TokenTests(BackendTestCase):
    flags = ("--token", "right-token")

    def test_wrong_or_missing_token_is_401_and_stores_nothing(self):
        self.assertEqual(self.backend.post(frames_batch("b1", [1]))[0], 401)
        self.assertEqual(self.backend.post(frames_batch("b1", [1]), token="wrong")[0], 401)
        self.assertEqual(self.backend.stats()["distinct_natural_keys"], 0)
        self.assertEqual(self.backend.post(frames_batch("b1", [1]), token="right-token")[0], 200)


class TokenFileTests(unittest.TestCase):
    def test_token_file(self):
        workdir = tempfile.mkdtemp(prefix="ferry-backend-test-")
        try:
            path = os.path.join(workdir, "token")
            with open(path, "w") as handle:
                handle.write("from-file\n")
            backend = Backend(workdir, "--token-file", path)
            try:
                self.assertEqual(backend.post(frames_batch("b1", [1]), token="from-file")[0], 200)
                self.assertEqual(backend.post(frames_batch("b2", [1]), token="from-fil")[0], 401)
            finally:
                backend.stop()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


class FaultTests(BackendTestCase):
    flags = ("--control", "--seed", "7")

    def test_fault_rate_one_gives_only_retryable_statuses_and_no_side_effect(self):
        self.backend.control(fault_rate=1.0, retry_after=3)
        seen = set()
        for index in range(40):
            status, headers, _ = self.backend.post(frames_batch("b%d" % index, [index + 1]))
            seen.add(status)
            if status in (429, 503):
                self.assertEqual(headers.get("Retry-After"), "3")
        self.assertEqual(seen, {500, 503, 429, 408})
        self.assertEqual(self.backend.stats()["distinct_natural_keys"], 0)
        self.backend.control(fault_rate=0.0)
        self.assertEqual(self.backend.post(frames_batch("b0", [1]))[0], 200)

    def test_lost_response_commits_then_drops_the_connection(self):
        self.backend.control(lost_response_rate=1.0)
        with self.assertRaises((http.client.RemoteDisconnected, ConnectionResetError)):
            self.backend.post(frames_batch("b1", [1, 2]))
        self.assertEqual(self.backend.stats()["distinct_natural_keys"], 2)
        self.backend.control(lost_response_rate=0.0)
        status, headers, _ = self.backend.post(frames_batch("b1", [1, 2]))
        self.assertEqual((status, headers.get("Idempotent-Replayed")), (200, "true"))
        stats = self.backend.stats()
        self.assertEqual((stats["responses_lost"], stats["duplicates_rejected"]), (1, 0))

    def test_forced_rejection_is_not_cached(self):
        self.backend.control(reject_status=422, reject_rate=1.0)
        self.assertEqual(self.backend.post(frames_batch("b1", [1]))[0], 422)
        self.assertEqual(self.backend.stats()["distinct_natural_keys"], 0)
        self.backend.control(reject_rate=0.0)
        self.assertEqual(self.backend.post(frames_batch("b1", [1]))[0], 200)

    def test_slow_responses(self):
        self.backend.control(slow_ms=300)
        started = time.monotonic()
        self.assertEqual(self.backend.post(frames_batch("b1", [1]))[0], 200)
        self.assertGreaterEqual(time.monotonic() - started, 0.3)


class RejectFlagTests(BackendTestCase):
    flags = ("--reject-status", "422", "--reject-rate", "1.0")

    def test_reject_flag(self):
        status, _, body = self.backend.post(frames_batch("b1", [1]))
        self.assertEqual((status, body["error"]), (422, "injected_rejection"))


@unittest.skipUnless(shutil.which("openssl"), "openssl CLI not installed")
class TLSTests(unittest.TestCase):
    def test_https_with_self_signed_certificate(self):
        workdir = tempfile.mkdtemp(prefix="ferry-backend-test-")
        try:
            cert, key = os.path.join(workdir, "cert.pem"), os.path.join(workdir, "key.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", cert,
                            "-days", "1", "-subj", "/CN=127.0.0.1",
                            "-addext", "subjectAltName=IP:127.0.0.1"],
                           check=True, capture_output=True)
            backend = Backend(workdir, "--tls-cert", cert, "--tls-key", key)
            try:
                trusting = ssl.create_default_context(cafile=cert)
                status, _, _ = backend.post(frames_batch("b1", [1]), tls_context=trusting)
                self.assertEqual(status, 200)
                with self.assertRaises(ssl.SSLCertVerificationError):
                    backend.post(frames_batch("b2", [1]), tls_context=ssl.create_default_context())
            finally:
                backend.stop()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
