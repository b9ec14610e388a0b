#!/usr/bin/env node
// Sends one batch to advantage-service over gRPC and prints each rollout's per-token advantages.
//
//   npm install                       # @grpc/grpc-js and @grpc/proto-loader
//   node example.js [host:port] [--json]
//
// The target defaults to localhost:50051. --json prints {"request", "response"}: the batch as
// the HTTP JSON request and the advantages per group and rollout, for programs to compare.
// The batch travels flat, as the service computes it: all tokens concatenated, `offsets`
// marking where each rollout starts, raw little-endian bytes with an explicit dtype.

"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");
const PROTO = "advantage/v1/advantage.proto";

// Two prompts with two rollouts each: the first rollout of each is correct.
const GROUPS = [
  {
    id: "prompt-1",
    rollouts: [
      { tokens: [11, 12, 13], reward: 1.0 },
      { tokens: [11, 14], reward: 0.0 },
    ],
  },
  {
    id: "prompt-2",
    rollouts: [
      { tokens: [21, 22, 23, 24], reward: 1.0 },
      { tokens: [21, 25, 26], reward: 0.0 },
    ],
  },
];
const ESTIMATOR = "ktae";
const RETURNS = ["scalar"];

function int32Tensor(values) {
  const data = Buffer.alloc(4 * values.length);
  values.forEach((v, i) => data.writeInt32LE(v, 4 * i));
  return { dtype: "DTYPE_INT32", data };
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

// The groups as the flat batch of a ComputeRequest.
function computeRequest(groups) {
  const groupIndex = [];
  const offsets = [0];
  const tokens = [];
  const rewards = [];
  groups.forEach((group, g) => {
    for (const rollout of group.rollouts) {
      groupIndex.push(g);
      tokens.push(...rollout.tokens);
      offsets.push(tokens.length);
      rewards.push(rollout.reward);
    }
  });
  return {
    options: { preset: ESTIMATOR, returns: RETURNS },
    group_ids: groups.map((group) => group.id),
    group_index: int32Tensor(groupIndex),
    offsets: int32Tensor(offsets),
    tokens: int32Tensor(tokens),
    rewards: float64Tensor(rewards),
  };
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
  const deadline = new Date(Date.now() + 30000);

  client.Compute(computeRequest(GROUPS), { deadline }, (err, response) => {
    client.close();
    if (err) {
      const code = err.metadata ? err.metadata.get("advantage-error-code")[0] : undefined;
      console.error(`advantage-service: ${err.details || err.message} (${code || err.code})`);
      process.exitCode = 1;
      return;
    }
    const groups = byGroup(response);
    if (json) {
      const request = { estimator: ESTIMATOR, return: RETURNS, groups: GROUPS };
      console.log(JSON.stringify({ request, response: { groups } }));
      return;
    }
    console.log(`estimator ${ESTIMATOR} on ${response.summary.device}, ` +
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
