'use strict';
const assert = require('assert');
const { sumNumbers } = require('./index');

assert.strictEqual(sumNumbers([1, '2', 'x', null, 3.5]), 6.5);
assert.strictEqual(sumNumbers([]), 0);
console.log('fixture tests passed');
