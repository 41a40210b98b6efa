-- The evidence store at PRAGMA user_version 1, as the code of 8c54bc4 created it
-- (pyctl/store.py ensure_schema, then xid.py, anchors/store.py, tokenizer/record.py).
-- Frozen: tests/test_schema.py migrates a database made from it.
CREATE TABLE "runs" (
   "run_id" TEXT PRIMARY KEY,
   "argv" TEXT,
   "kind" TEXT,
   "kernel" TEXT,
   "host" TEXT,
   "mechanism" TEXT,
   "capabilities" TEXT,
   "started" REAL,
   "ended" REAL,
   "status" TEXT,
   "exit_code" INTEGER,
   "stats" TEXT
);
CREATE TABLE "specs" (
   "run_id" TEXT,
   "spec" INTEGER,
   "text" TEXT,
   "json" TEXT,
   PRIMARY KEY ("run_id", "spec")
);
CREATE TABLE "funcs" (
   "run_id" TEXT,
   "func" INTEGER,
   "library" TEXT,
   "build_id" TEXT,
   "symbol" TEXT,
   "offset" INTEGER,
   "address" INTEGER,
   "first_insn" TEXT,
   PRIMARY KEY ("run_id", "func")
);
CREATE TABLE "faults" (
   "fault_id" TEXT PRIMARY KEY,
   "run_id" TEXT,
   "seq" INTEGER,
   "spec" INTEGER,
   "func" INTEGER,
   "function" TEXT,
   "library" TEXT,
   "build_id" TEXT,
   "action" TEXT,
   "mechanism" TEXT,
   "retval" INTEGER,
   "call_seq" INTEGER,
   "pid" INTEGER,
   "tid" INTEGER,
   "comm" TEXT,
   "ts_ns" INTEGER,
   "wall" REAL,
   "ret" INTEGER,
   "latency_ns" INTEGER,
   "outcome" TEXT
);
CREATE TABLE "registers" (
   "fault_id" TEXT,
   "reg" TEXT,
   "value" INTEGER,
   PRIMARY KEY ("fault_id", "reg")
);
CREATE TABLE "args" (
   "fault_id" TEXT,
   "idx" INTEGER,
   "name" TEXT,
   "raw" INTEGER,
   "decoded" TEXT,
   PRIMARY KEY ("fault_id", "idx")
);
CREATE TABLE "stacks" (
   "fault_id" TEXT,
   "depth" INTEGER,
   "address" INTEGER,
   "symbol" TEXT,
   "module" TEXT,
   "offset" INTEGER,
   PRIMARY KEY ("fault_id", "depth")
);
CREATE TABLE "links" (
   "id" INTEGER PRIMARY KEY,
   "fault_id" TEXT,
   "run_id" TEXT,
   "kind" TEXT,
   "rule" TEXT,
   "ts_ns" INTEGER,
   "pid" INTEGER,
   "tid" INTEGER,
   "detail" TEXT
);
CREATE TABLE calls (run_id TEXT, ts_ns INTEGER, latency_ns INTEGER, spec INTEGER, func INTEGER, call_seq INTEGER, fault_id TEXT, pid INTEGER, tid INTEGER, kind INTEGER, ret INTEGER, arg1 INTEGER, arg2 INTEGER, arg3 INTEGER, arg4 INTEGER, arg5 INTEGER, arg6 INTEGER);
CREATE INDEX calls_run ON calls(run_id, func);
CREATE INDEX faults_run ON faults(run_id);
CREATE INDEX links_fault ON links(fault_id);
CREATE TABLE "xids" (
   "id" INTEGER PRIMARY KEY,
   "fault_id" TEXT,
   "run_id" TEXT,
   "dev" TEXT,
   "error_code" INTEGER,
   "msg" TEXT,
   "ts_ns" INTEGER,
   "pid" INTEGER,
   "tid" INTEGER,
   "rule" TEXT
);
CREATE TABLE "anchors" (
   "id" INTEGER PRIMARY KEY,
   "fault_id" TEXT NOT NULL,
   "kind" TEXT NOT NULL,
   "run_id" INTEGER,
   "fault_seq" INTEGER,
   "from_context" INTEGER,
   "rec_seq" INTEGER,
   "mono_ns" INTEGER,
   "wall_ns" INTEGER,
   "bdf" TEXT,
   "vendor" INTEGER,
   "device" INTEGER,
   "code" INTEGER,
   "pid" INTEGER,
   "ctx_pid" INTEGER,
   "comm" TEXT,
   "config_ok" INTEGER,
   "config" BLOB,
   "devsta" INTEGER,
   "aer_pos" INTEGER,
   "aer" TEXT,
   "bar0" TEXT
);
CREATE INDEX "idx_anchors_fault_id"
    ON "anchors" ("fault_id");
CREATE TABLE "tok_cases" (
   "fault_id" TEXT PRIMARY KEY,
   "run_id" TEXT,
   "seq" INTEGER,
   "campaign" TEXT,
   "kind" TEXT,
   "input_sha256" TEXT,
   "input_len" INTEGER,
   "input_bytes" INTEGER,
   "text" TEXT,
   "outcome" TEXT,
   "error" TEXT,
   "latency_ns" INTEGER,
   "details" TEXT
);
CREATE INDEX tok_cases_run ON tok_cases(run_id, campaign);
PRAGMA user_version=1;
