#!/usr/bin/env node
// Sends one batch to advantage-service over gRPC and prints each rollout's per-token advantages.
//
//   npm install                       # @grpc/grpc-js and @grpc/proto-loader
//   node example.js [host:port] [--json] [--estimator=NAME]
//
// The target defaults to localhost:50051, the estimator to the preset ktae (forking and otb use
// the rollouts' entropy, logprobs and sum_pi_squared). --json prints {"request", "response"}:
// the batch as the HTTP JSON request and the advantages per group and rollout, for programs to
// compare. The batch travels flat, as the service computes it: all tokens concatenated,
// `offsets` marking where each rollout starts, raw little-endian bytes with an explicit dtype;
// each per-token array a rollout gives (logprobs, entropy, ...) is one flat float32 tensor.
//
// UNAVAILABLE (status 14) is retried a few times: the service answers it when it is overloaded
// (its queue is full; `advantage-error-code: overloaded`, with `retry-after-ms` saying how long
// to wait) and while a server restarts. The wait is retry-after-ms plus up to 20% jitter, else
// retry-after seconds, else an exponential backoff.

"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");
const PROTO = "advantage/v1/advantage.proto";

// Two prompts with two rollouts each: the first rollout of each is correct. Beside its tokens,
// each rollout carries what the trainer's forward pass gives per token: the sampled token's
// log-probability, the entropy of the distribution it was sampled from, and sum_v pi(v)^2.
const GROUPS = [
  {
    id: "prompt-1",
    rollouts: [
      {
        tokens: [11, 12, 13], reward: 1.0,
        logprobs: [-0.25, -1.5, -0.5], entropy: [0.5, 2.0, 1.25],
        sum_pi_squared: [0.625, 0.25, 0.5],
      },
      {
        tokens: [11, 14], reward: 0.0,
        logprobs: [-0.25, -2.0], entropy: [0.5, 2.5],
        sum_pi_squared: [0.625, 0.375],
      },
    ],
  },
  {
    id: "prompt-2",
    rollouts: [
      {
        tokens: [21, 22, 23, 24], reward: 1.0,
        logprobs: [-0.125, -1.0, -0.5, -0.25], entropy: [0.25, 1.5, 1.0, 0.75],
        sum_pi_squared: [0.78125, 0.25, 0.5, 0.625],
      },
      {
        tokens: [21, 25, 26], reward: 0.0,
        logprobs: [-0.125, -2.0, -1.5], entropy: [0.25, 3.0, 2.0],
        sum_pi_squared: [0.78125, 0.375, 0.25],
      },
    ],
  },
];
// The optional per-token arrays of a rollout (the .proto's ComputeRequest fields).
const PER_TOKEN = ["logprobs", "entropy", "sum_pi_squared", "is_weights"];
const DEFAULT_ESTIMATOR = "ktae";
const RETURNS = ["scalar"];
const DEADLINE_MS = 30000; // per attempt
const RETRIES = 4; // tries after the first
const BACKOFF_MS = 200; // the n-th retry waits 100% to 50% of BACKOFF_MS * 2^n without a hint
const MAX_BACKOFF_MS = 10000; // no wait is longer, hint or not

function int32Tensor(values) {
  const data = Buffer.alloc(4 * values.length);
  values.forEach((v, i) => data.writeInt32LE(v, 4 * i));
  return { dtype: "DTYPE_INT32", data };
}

function float32Tensor(values) {
  const data = Buffer.alloc(4 * values.length);
  values.forEach((v, i) => data.writeFloatLE(v, 4 * i));
  return { dtype: "DTYPE_FLOAT32", data };
}

function float64Tensor(values) {
  const data = Buffer.alloc(8 * values.length);
  values.forEach((v, i) => data.writeDoubleLE(v, 8 * i));
  return { dtype: "DTYPE_FLOAT64", data };
}

function readTensor(tensor) {
  const readers = {
    DTYPE_INT32: [4, (b, o) => b.readInt32LE(o)],
    DTYPE_INT64: [8, (b, o) => Number(b.readBigInt64LE(o))],
    DTYPE_FLOAT32: [4, (b, o) => b.readFloatLE(o)],
    DTYPE_FLOAT64: [8, (b, o) => b.readDoubleLE(o)],
  };
  const [size, read] = readers[tensor.dtype];
  const out = [];
  for (let offset = 0; offset < tensor.data.length; offset += size) {
    out.push(read(tensor.data, offset));
  }
  return out;
}

// The groups as the flat batch of a ComputeRequest. A per-token array (or teacher condition)
// travels when the rollouts give it: the service refuses one given for some rollouts only,
// naming the first rollout without it.
function computeRequest(groups, estimator) {
  const groupIndex = [];
  const offsets = [0];
  const tokens = [];
  const rewards = [];
  const rollouts = groups.flatMap((group) => group.rollouts);
  const perToken = {};
  for (const name of PER_TOKEN) {
    if (rollouts.some((r) => r[name] !== undefined)) perToken[name] = [];
  }
  const teachers = {};
  for (const r of rollouts) {
    for (const name of Object.keys(r.teacher_logprobs || {})) teachers[name] = [];
  }
  groups.forEach((group, g) => {
    for (const rollout of group.rollouts) {
      groupIndex.push(g);
      tokens.push(...rollout.tokens);
      offsets.push(tokens.length);
      rewards.push(rollout.reward);
      for (const [name, values] of Object.entries(perToken)) values.push(...(rollout[name] || []));
      for (const [name, values] of Object.entries(teachers)) {
        values.push(...((rollout.teacher_logprobs || {})[name] || []));
      }
    }
  });
  const request = {
    options: { preset: estimator, returns: RETURNS },
    group_ids: groups.map((group) => group.id),
    group_index: int32Tensor(groupIndex),
    offsets: int32Tensor(offsets),
    tokens: int32Tensor(tokens),
    rewards: float64Tensor(rewards),
    teacher_logprobs: {},
  };
  for (const [name, values] of Object.entries(perToken)) request[name] = float32Tensor(values);
  for (const [name, values] of Object.entries(teachers)) {
    request.teacher_logprobs[name] = float32Tensor(values);
  }
  return request;
}

function metadataValue(err, key) {
  const values = err.metadata ? err.metadata.get(key) : [];
  return values.length ? String(values[0]) : undefined;
}

// Worth another try: UNAVAILABLE (overloaded, or no server yet), and the 429-like
// RESOURCE_EXHAUSTED "saturated" of services that predate the queue.
function retryable(err) {
  return err.code === grpc.status.UNAVAILABLE ||
    metadataValue(err, "advantage-error-code") === "saturated";
}

// How long to wait before retry `attempt` (0 first): the service's hint, else a backoff.
function retryDelayMs(err, attempt) {
  const hintMs = Number(metadataValue(err, "retry-after-ms"));
  if (metadataValue(err, "retry-after-ms") !== undefined && hintMs >= 0) {
    return Math.min(MAX_BACKOFF_MS, hintMs * (1 + 0.2 * Math.random()));
  }
  const ceiling = Math.min(MAX_BACKOFF_MS, BACKOFF_MS * 2 ** attempt);
  let wait = ceiling * (0.5 + 0.5 * Math.random());
  const seconds = Number(metadataValue(err, "retry-after"));
  if (metadataValue(err, "retry-after") !== undefined && seconds >= 0) {
    wait = Math.max(wait, Math.min(MAX_BACKOFF_MS, 1000 * seconds));
  }
  return wait;
}

// Compute, retrying what is worth retrying; `done(err, response)` once it is over.
function computeWithRetries(client, request, attempt, done) {
  const deadline = new Date(Date.now() + DEADLINE_MS);
  client.Compute(request, { deadline }, (err, response) => {
    if (err && retryable(err) && attempt < RETRIES) {
      const wait = Math.round(retryDelayMs(err, attempt));
      const code = metadataValue(err, "advantage-error-code");
      const why = code === "overloaded" || code === "saturated" ?
        `is overloaded (${err.details})` : `is unavailable (${err.details || err.message})`;
      console.error(`advantage-service ${why}; retrying in ${wait} ms ` +
        `(retry ${attempt + 1} of ${RETRIES})`);
      setTimeout(() => computeWithRetries(client, request, attempt + 1, done), wait);
      return;
    }
    done(err, response, attempt);
  });
}

// The flat response back into groups of rollouts.
function byGroup(response) {
  const offsets = readTensor(response.offsets);
  const groupIndex = readTensor(response.group_index);
  const advantages = readTensor(response.advantages);
  const scalars = response.scalars ? readTensor(response.scalars) : [];
  const groups = response.group_ids.map((id) => ({ id, rollouts: [] }));
  groupIndex.forEach((g, i) => {
    groups[g].rollouts.push({
      advantages: advantages.slice(offsets[i], offsets[i + 1]),
      scalar: scalars[i],
    });
  });
  return groups;
}

function main() {
  const args = process.argv.slice(2);
  const json = args.includes("--json");
  const target = args.find((a) => !a.startsWith("--")) || "localhost:50051";
  const chosen = args.find((a) => a.startsWith("--estimator="));
  const estimator = chosen ? chosen.slice("--estimator=".length) : DEFAULT_ESTIMATOR;

  const definition = protoLoader.loadSync(PROTO, {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const { AdvantageService } = grpc.loadPackageDefinition(definition).advantage.v1;
  const client = new AdvantageService(target, grpc.credentials.createInsecure());

  computeWithRetries(client, computeRequest(GROUPS, estimator), 0, (err, response, attempt) => {
    client.close();
    if (err) {
      const code = metadataValue(err, "advantage-error-code");
      const tries = attempt ? ` after ${attempt + 1} tries` : "";
      console.error(`advantage-service: ${err.details || err.message} (${code || err.code})${tries}`);
      process.exitCode = 1;
      return;
    }
    const groups = byGroup(response);
    if (json) {
      const request = { estimator, return: RETURNS, groups: GROUPS };
      console.log(JSON.stringify({ request, response: { groups } }));
      return;
    }
    console.log(`estimator ${estimator} on ${response.summary.device}, ` +
      `${response.summary.tokens} tokens in ${response.summary.compute_ms} ms`);
    for (const group of groups) {
      group.rollouts.forEach((rollout, i) => {
        const values = rollout.advantages.map((a) => a.toFixed(4)).join(", ");
        console.log(`${group.id} rollout ${i}: scalar ${rollout.scalar.toFixed(4)}, ` +
          `advantages [${values}]`);
      });
    }
  });
}

main();
